"""TuneBoard's engine (see ARCHITECTURE.md). Importing the package installs one log filter, before any module of it can
import peft (and through it bitsandbytes), wherever that import sits."""
import logging


class _NoKernelsNotice(logging.Filter):
    """peft imports bitsandbytes whenever it is installed (peft/helpers.py, also through TRL's trainers), and
    bitsandbytes' CPU backend then logs "Failed to load CPU gemm_4bit_forward from kernels-community" (the
    optional `kernels` package). That import cannot be made lazy, and the notice is about a 4-bit kernel: it is
    dropped, so a run (or chat server, or export) without quantization does not open with it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsNotice())
