"""Greyhound: eBPF fail-slow detection for distributed training.

The tracer (``greyhound_bpf.tracer``) times NCCL, CUDA runtime and gloo calls
of a running job with uprobes; ``greyhound_bpf.session`` turns them into the
event stream described in docs/events.md; ``greyhound-trace`` is the CLI.
"""

__version__ = "0.1.0"


class GreyhoundError(Exception):
    """An error the user can act on: printed as one line, never a traceback.

    ``exit_code`` is 2 for bad input (a PID, an argument, a target without
    the libraries) and 1 for an environment problem (not root, no BCC, the
    kernel refusing a probe).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
