"""On-device statistics of a list of tensors, with no host-device sync (docs/numerics.md,
Statistics).

Two kinds:

* *light* statistics (:mod:`.light`, every step): per tensor its peak magnitude and its L2 norm,
  unscaled; and peaks alone, for the parameter check and the light module taps;
* *full* statistics (:mod:`.full`, on sampled and escalated steps): counts of zeros, subnormals,
  NaNs and infs, a binade histogram, the smallest and largest magnitudes, the norm and the zeros
  in zero lines, per tensor or for all of them together (their results: :mod:`.full_results`).

Each kind has two algorithms, in its own module: *host* for CPU tensors, *accelerator* (a fixed
number of launches, no float atomics) for every other device; the full statistics have a third,
*triton* (:mod:`.full_triton`, fused kernels in :mod:`.full_triton_kernels`), used on CUDA wherever
Triton runs. :mod:`.algorithms` says which one runs: :func:`algorithm_for` the device, or
``algorithm=`` explicitly, so the tests also run the accelerator one on CPU tensors. On the writer
thread, host copies of either kind become numpy arrays per slot (:class:`HostStats`,
:mod:`.host_stats`).
"""

from .algorithms import ALGORITHMS, FULL_ALGORITHMS, algorithm_for
from .full import CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS, SlotLayouts, full_stats, zero_line_elements
from .full_results import FullStats, stats_to_host
from .host_stats import HostStats
from .light import LightStats, extremes, light_stats, peaks_from_extremes, peaks_of_pairs, tensor_peaks

__all__ = ["ALGORITHMS", "FULL_ALGORITHMS", "algorithm_for", "CHUNK_ELEMENTS", "CPU_CHUNK_ELEMENTS", "FullStats", "SlotLayouts",
           "full_stats", "stats_to_host", "zero_line_elements", "HostStats", "LightStats", "extremes", "light_stats",
           "peaks_from_extremes", "peaks_of_pairs", "tensor_peaks"]
