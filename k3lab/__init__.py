"""k3lab: a research workbench for the Kimi K3 decode path. Importing it stays light: plotly,
papermill and nsight are imported where they are used."""
from k3lab.config import GpuView, K3Config, preset
from k3lab.switches import Switches

__version__ = "0.1.0"
__all__ = ["GpuView", "K3Config", "Switches", "preset", "__version__"]


def _register_kernels_from_checkout() -> None:
    """`kernels/` installs as `k3lab_kernels`. Where k3lab runs from a checkout without being installed
    (a GPU machine with no package index, PYTHONPATH pointing at the repo), map the name onto the
    folder beside this package so the kernels still import under their one name."""
    import importlib.util
    import sys
    from pathlib import Path

    if "k3lab_kernels" in sys.modules or importlib.util.find_spec("k3lab_kernels") is not None:
        return
    init = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if init.exists():
        spec = importlib.util.spec_from_file_location("k3lab_kernels", init,
                                                      submodule_search_locations=[str(init.parent)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["k3lab_kernels"] = mod
        spec.loader.exec_module(mod)


_register_kernels_from_checkout()
