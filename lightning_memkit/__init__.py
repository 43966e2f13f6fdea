"""lightning_memkit: Lightning callbacks, a precision plugin and a pipeline strategy that cut peak memory.

Importing the package registers ``strategy="memkit_pipeline"`` with Lightning (once).
"""

from lightning_memkit.memory import LivePeak

__version__ = "0.1.0"
__all__ = ["LivePeak", "__version__"]
