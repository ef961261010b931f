"""The demo's scenarios and defaults: plain data, importable without torch (the CLI's options
list them)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PATH = "ampdoctor-demo.parquet"
CPU_STEPS, CUDA_STEPS = 150, 500


@dataclass(frozen=True)
class Scenario:
    """How the demo trains: scaler settings, a factor on the loss, and an optional fault."""

    description: str
    explained_by: str = "report"        # the command that explains the run: "report" or "postmortem"
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    loss_factor: float = 1.0            # multiplies the loss passed to scale()
    level: str = "params"
    fault_module: str | None = None     # a module whose weight a bad update blows up (see fault_step) ...
    fault_peak: float = 0.0             # ... to this largest magnitude
    fault_outlier: bool = False         # only its largest element becomes fault_peak (an outlier), at mid-run
    module_every: int | None = None     # the recorder's module_every (None: its default)


SCENARIOS: dict[str, Scenario] = {
    "healthy": Scenario("torch's default GradScaler settings: nothing to fix"),
    "underflow": Scenario("loss * 1e-4, init_scale=1: small gradients underflow to zero in fp16",
                          init_scale=1.0, loss_factor=1e-4),
    # level="full": the flight recorder names where each overflow starts, the first one included.
    "overflow": Scenario("init_scale=2**24, growth_interval=10: overflow after overflow",
                         init_scale=2.0**24, growth_interval=10, level="full"),
    # The weight stays within fp16's range (2**15 < 65504): its matmul's output is what overflows, so
    # the postmortem names the module, not a parameter. level="full" records the module taps.
    "nan": Scenario("near the end, blocks.1.mlp.0's weight blows up: fp16 overflow, NaN loss",
                    explained_by="postmortem", level="full", fault_module="blocks.1.mlp.0", fault_peak=2.0**15),
    # An outlier that fp16 holds but a tensorwise FP8 scale cannot: with it as the amax, most of the
    # weight falls below E4M3's smallest subnormal. level="full" records the GEMM operands.
    "fp8": Scenario("midway, one weight of blocks.1.mlp.0 becomes an outlier (2**12): fp16 trains on, FP8 would "
                    "flush", explained_by="fp8", level="full", fault_module="blocks.1.mlp.0", fault_peak=2.0**12,
                    fault_outlier=True, module_every=25),
}
