"""plugins."""

from lightning_memkit.plugins.nosave_bitsandbytes import NoSaveBitsandbytesPrecision  # noqa: F401
