"""Experiment only (issue 22): on PYTHONPATH, turns kernels/prefetch.l2_prefetch into a no-op in
every process, so that one tree measures the model with and without the L2 prefetch."""
import minisgl.kernels.prefetch as _prefetch


def _off(weight: object) -> None:
    return None


_prefetch.l2_prefetch = _off  # type: ignore[assignment]
