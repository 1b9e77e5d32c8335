"""The decode step's A/B folds (experiments/step_folds/step_ab.py) name only settings that exist: a device call that
sets a removed knob would fail after minutes of setup (every arm's "module:NAME" or k3lab.step name is an attribute
now, every "switch:NAME" value one the switch allows, and every "policy:COMPONENT.OP" rule list an op's backends and
options)."""
import importlib
import importlib.util
from pathlib import Path

import pytest

from k3lab import policy, registry
from k3lab.switches import ALLOWED

PATH = Path(__file__).resolve().parent.parent / "experiments" / "step_folds" / "step_ab.py"


def _folds() -> dict:
    spec = importlib.util.spec_from_file_location("step_ab", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FOLDS


@pytest.mark.parametrize("fold, arms", sorted(_folds().items()), ids=lambda v: v if isinstance(v, str) else "")
def test_fold_arms_name_existing_settings(fold, arms):
    import k3lab.step as S

    assert len(arms) >= 2 and len({a[0] for a in arms}) == len(arms), f"{fold}: two or more arms, distinct names"
    for name, settings in arms:
        for key, value in settings.items():
            if key.startswith("switch:"):
                assert value in ALLOWED[key[7:]], f"{fold}/{name}: {key}={value!r} not allowed"
            elif key.startswith("policy:"):  # an op's rules of the auto table: the op has rules, each one valid
                comp, op = key[7:].split(".")
                assert op in policy.table(comp), f"{fold}/{name}: data/{comp}_defaults.json has no {op!r}"
                for r in value:
                    be, opts = r["backend"], policy.options_of(r)
                    assert be in registry.get(op).backends, f"{fold}/{name}: {be!r} runs no {op}"
                    for k, v in opts.items():
                        allowed = registry.get(op).option_axes.get(k, {}).get(be)
                        assert allowed is not None and v in allowed, f"{fold}/{name}: {op} option {k}={v!r}"
            elif ":" in key:
                mod, attr = key.split(":")
                assert hasattr(importlib.import_module(mod), attr), f"{fold}/{name}: {key} does not exist"
            else:
                assert hasattr(S, key), f"{fold}/{name}: k3lab.step.{key} does not exist"
