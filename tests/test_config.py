"""K3Config loading and validation, presets and GpuView, Switches validation and parameters."""
import json

import pytest

from k3lab.config import DATA_DIR, ConfigError, GpuView, K3Config, k3_full, k3_tiny, preset
from k3lab.switches import ALLOWED, BACKENDS, COMPONENTS, SwitchError, Switches, describe


def test_full_config_from_data_file():
    cfg = K3Config.from_json(DATA_DIR / "k3_config.json")
    assert cfg == k3_full()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 93, 96)
    assert len(cfg.mla_layer_ids) == 24 and cfg.n_kda_layers == 69
    assert cfg.layer_kind(3) == "mla" and cfg.layer_kind(1) == "kda"
    assert cfg.mlp_kind(0) == "dense" and cfg.mlp_kind(1) == "moe"
    assert cfg.extra["routed_expert_format"] == "mxfp4"
    assert cfg.qk_head_dim == 192


def test_from_dict_under_text_config_and_aliases():
    d = {"architectures": ["X"], "text_config": {"hidden_size": 64, "num_hidden_layers": 4,
                                                 "num_attention_heads": 4, "n_experts": 8, "moe_topk": 2,
                                                 "something_new": 1}}
    cfg = K3Config.from_dict(d)
    assert cfg.hidden_size == 64 and cfg.n_routed_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.extra["something_new"] == 1 and cfg.extra["architectures"] == ["X"]
    assert cfg.mla_layer_ids == (3,)  # 3:1 pattern without a layout
    flat = K3Config.from_dict(d["text_config"])
    assert flat == cfg
    assert K3Config.from_dict(cfg.to_dict()) == cfg


def test_round_trip_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"text_config": k3_tiny().to_dict()}))
    assert K3Config.from_json(p) == k3_tiny()


@pytest.mark.parametrize("d,msg", [
    ({"hidden_size": 64, "num_hidden_layers": 4}, "missing required fields"),
    ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": "64", "num_hidden_layers": 4, "num_attention_heads": 4}, "hidden_size"),
    ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "n_routed_experts": 4,
      "num_experts_per_tok": 8}, "num_experts_per_tok"),
    ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "mla_layers": [1, 9]}, "mla_layers"),
    ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "kda_gate_lower_bound": 1.0},
     "kda_gate_lower_bound"),
    ({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "first_k_dense": 9}, "first_k_dense"),
])
def test_bad_configs_name_the_field(d, msg):
    with pytest.raises(ConfigError, match=msg):
        K3Config.from_dict(d)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="JSON object"):
        K3Config.from_dict([1, 2])
    with pytest.raises(ConfigError, match="does not exist"):
        K3Config.from_json("/nonexistent/config.json")
    with pytest.raises(ConfigError, match="layer index"):
        k3_tiny().layer_kind(99)


def test_presets_and_gpu_view():
    v = preset("tp8")
    assert v.heads == 12 and v.kda_width == 1536 and v.expert_inter == 384
    assert preset("tp16").heads == 6 and preset("tp16").expert_inter == 192
    t = preset("tiny")
    assert t.context == 64 and t.cfg.attnres_block_size == 3
    assert GpuView(k3_full(), dcp=8, context=142000).context_per_gpu == 17750
    assert GpuView(k3_full(), draft_depth=3).tokens_per_seq == 4
    with pytest.raises(ConfigError, match="preset"):
        preset("huge")
    for kw, msg in [({"tp": 5}, "tp=5"), ({"dcp": 0}, "dcp"), ({"batch": 0}, "batch"),
                    ({"draft_depth": 9}, "draft_depth"), ({"kv_dtype": "int8"}, "kv_dtype"),
                    ({"expert_dtype": "fp4"}, "expert_dtype"), ({"act_dtype": "fp16"}, "act_dtype")]:
        with pytest.raises(ConfigError, match=msg):
            GpuView(k3_full(), **kw)


# ---- Switches -----------------------------------------------------------------------------------

def test_switch_defaults_and_round_trip():
    s = Switches()
    assert s.backend == {c: "reference" for c in COMPONENTS} and s.mla_partitions == "auto"
    assert Switches.from_dict(json.loads(s.to_json())) == s
    s2 = s.replace(mla_partitions=4, backend_kda="triton")
    assert s2.mla_partitions == 4 and s2.backend["kda"] == "triton" and s2.backend["mla"] == "reference"


def test_one_owner_and_unwired_switches_are_refused_by_name():
    from k3lab.switches import NOT_WIRED, VIEW_SETTINGS

    for name in VIEW_SETTINGS:
        with pytest.raises(SwitchError, match="GPU view"):
            Switches.from_dict({name: 1})
    for name in NOT_WIRED:
        other = next(v for v in ALLOWED[name] if v != getattr(Switches(), name))
        with pytest.raises(SwitchError, match=f"'{name}'.*declared but not wired yet"):
            Switches(**{name: other})


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_invalid_switch_values_name_switch_and_allowed(name):
    bad = "nope" if not isinstance(ALLOWED[name][0], str) else 12345
    with pytest.raises(SwitchError) as e:
        Switches(**{name: bad})
    assert repr(name) in str(e.value) and describe(ALLOWED[name]) in str(e.value)


def test_mla_partitions_takes_any_count_in_1_to_64():
    assert [Switches(mla_partitions=p).mla_partitions for p in (1, 3, 12, 64)] == [1, 3, 12, 64]
    for bad in (0, 65, 2.0, "4"):
        with pytest.raises(SwitchError, match=r"'mla_partitions' = .* an int in 1\.\.64 or 'auto'"):
            Switches(mla_partitions=bad)


def test_switch_bool_is_not_an_int_and_backends():
    with pytest.raises(SwitchError, match="'mla_partitions'"):
        Switches(mla_partitions=True)
    with pytest.raises(SwitchError, match="unknown component"):
        Switches(backend={"gpu": "reference"})
    with pytest.raises(SwitchError, match=r"backend\[mla\]"):
        Switches(backend={"mla": "cuda"})
    with pytest.raises(SwitchError, match="unknown switch"):
        Switches.from_dict({"dcpp": 2})


def test_from_params():
    s = Switches.from_params({"backend": "torch_compile", "backend_kda": "reference", "dcp": 8, "pad_heads": 16,
                              "batch": 4, "notebook_title": "x"})
    assert s.backend["kda"] == "reference" and s.backend["mla"] == "torch_compile"
    assert s.pad_heads == 16 and not hasattr(s, "dcp")  # dcp is the view's (k3lab.config.GpuView)
    assert Switches.from_params({"mla_partitions": 3}).mla_partitions == 3
    with pytest.raises(SwitchError, match="'mla_partitions'"):
        Switches.from_params({"mla_partitions": 100})
    assert set(BACKENDS) >= {"reference", "torch_compile"}


@pytest.mark.parametrize("name, value", [("batch", "abc"), ("batch", 2.5), ("batch", True), ("context", 1.5),
                                         ("draft_depth", "1"), ("dcp", True)])
def test_view_sizes_must_be_ints(name, value):
    """A size of another type is refused by name (before: a TypeError naming nothing, or a float batch accepted)."""
    with pytest.raises(ConfigError, match=f"{name} must be an int"):
        GpuView(k3_full(), tp=8, **{name: value})
