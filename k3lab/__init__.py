"""k3lab: a research workbench for the Kimi K3 decode path. Importing it stays light: plotly,
papermill and nsight are imported where they are used."""
from k3lab.config import GpuView, K3Config, preset
from k3lab.switches import Switches

__version__ = "0.1.0"
__all__ = ["GpuView", "K3Config", "Switches", "preset", "__version__"]
