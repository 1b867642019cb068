"""profile_memory.py's `--gpu_memory`: whether a step fits a GPU, and if not the cheapest change that makes it fit
(`check_fit`), searched over the estimates of training/estimate.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from modeling.config import GiB
from modeling.memtrack import CATEGORIES
from training import estimate as est
from training.estimate import MAX_WORLD_SIZE, PHASES, StepConfig
from training.options import TILED_FFN_CHUNK


def _recipe_steps(config: StepConfig, result: dict) -> Iterator[tuple[str, StepConfig]]:
    """Changes of the memory recipe, cheapest first, each on top of the previous ones, as train.py options: chunked
    loss (almost free), checkpointing (~1/3 more compute), a tiled FFN (one more FFN forward), activation offload
    (host memory and PCIe traffic, overlapped with compute)."""
    compute = config.configs()[1]
    if result["loss_path"] == "standard":
        config = config.replace(loss="chunked")
        yield "--loss chunked", config
    if not config.train.gradient_checkpointing:
        config = config.replace(gradient_checkpointing=True)
        yield "--gradient_checkpointing", config
    if compute.ffn_chunk_size is None and config.train.context_length > TILED_FFN_CHUNK:
        config = config.replace(ffn_chunk_size=TILED_FFN_CHUNK)
        yield f"--ffn_chunk_size {TILED_FFN_CHUNK}", config
    if not compute.offload_activations:
        config = config.replace(offload_activations=True)
        yield "--offload_activations", config


def _task_steps(config: StepConfig) -> Iterator[tuple[str, StepConfig]]:
    """Changes of what a step computes: a smaller batch (fewer tokens per step unless accumulated), then a shorter
    context (changes the task), halving each time."""
    while config.train.batch_size > 1:
        config = config.replace(batch_size=config.train.batch_size // 2)
        yield f"--batch_size {config.train.batch_size}", config
    while config.train.context_length > 1024:
        config = config.replace(context_length=config.train.context_length // 2)
        yield f"--context_length {config.train.context_length}", config


def peak_at_world_size(results: dict[int, dict], world_size: int) -> int:
    """The peak (bytes per rank) at `world_size` from estimates at two FSDP world sizes ({world size: estimate}):
    each phase's peak is affine in 1 / world size (FSDP2 divides the fp32 weights, their gradients and the AdamW
    moments by it; activations, temporaries and the unsharded compute copies of a block do not change)."""
    (w1, r1), (w2, r2) = results.items()
    peaks = []
    for phase in PHASES:  # with --nsa_exact_selection_steps, the larger of the two steps' in each phase
        v1, v2 = (r.get("warm_up", {}).get("phase_peaks", {}).get(phase, r["stages"][f"peak during {phase}"]["total"])
                  for r in (r1, r2))
        slope = (v1 - v2) / (1 / w1 - 1 / w2)
        peaks.append(v1 + slope * (1 / world_size - 1 / w1))
    return round(max(peaks))


def _more_ranks(config: StepConfig, result: dict, sizes: list[int], fits: Callable[[float], bool],
                log: Callable[[str], None], progress: Callable[[str], None]) -> tuple[int, float, str] | None:
    """The smallest of the world sizes `sizes` (increasing, above config's) at which the step of `result` fits:
    (world size, peak bytes, how it was found), or None. Costs at most two estimates: the first larger world size is
    estimated (with world size 1, the first two: one process does not shard), the rest derived from two FSDP points
    by `peak_at_world_size`."""
    points = {config.world_size: result} if config.world_size > 1 else {}
    for W in sizes:
        if len(points) < 2:
            progress(f"estimating --world_size {W}")
            points[W] = est.estimate(config.replace(world_size=W), progress)
            peak, how = points[W]["peak"]["total"], "estimated"
            log(f"  trying --world_size {W}: peak {peak / GiB:.2f} GiB")
        else:
            peak = peak_at_world_size(points, W)
            how = f"derived from the estimates at world sizes {' and '.join(map(str, points))}"
        if fits(peak):
            return W, peak, how
    return None


def check_fit(result: dict, gpu_memory_gib: float, reserve_gib: float = 2.0, log: Callable[[str], None] = print,
              progress: Callable[[str], None] | None = None) -> dict:
    """Whether the step of `result` fits a GPU of `gpu_memory_gib` GiB, keeping `reserve_gib` for what the tracker
    does not see. If not, the cheapest change that fits, searched in order of cost: the memory recipe
    (`_recipe_steps`, one estimate each), more GPUs (`_more_ranks`: at most two estimates for every world size up
    to 64 times the asked one), then a smaller batch or a shorter context at the asked world size (`_task_steps`,
    one estimate each, each step cheaper than the last). The report names the change as flags, each once
    ("change"), with the peak it gives ("fitting_peak_gib", "how": estimated or derived)."""
    progress = progress or (lambda message: None)
    budget = (gpu_memory_gib - reserve_gib) * GiB
    report = {"gpu_memory_gib": gpu_memory_gib, "reserve_gib": reserve_gib, "fits": result["peak"]["total"] <= budget,
              "margin_gib": (budget - result["peak"]["total"]) / GiB, "change": None, "tried": [],
              "fitting_config": None}
    if report["fits"]:
        return report

    def found(flags: list[str], config: StepConfig, peak: float, how: str) -> dict:
        return {**report, "change": flags, "fitting_config": config.to_dict(), "fitting_peak_gib": peak / GiB,
                "how": how}

    config, current, flags = StepConfig.from_dict(result["config"]), result, []
    for flag, candidate in _recipe_steps(config, result):
        flags.append(flag)
        report["tried"].append(" ".join(flags))
        progress(f"estimating {' '.join(flags)}")
        config, current = candidate, est.estimate(candidate, progress)
        log(f"  trying {' '.join(flags)}: peak {current['peak']['total'] / GiB:.2f} GiB")
        if current["peak"]["total"] <= budget:
            return found(flags, config, current["peak"]["total"], "estimated")
    unshardable = current["peak"]["total"] - sum(current["peak"][k] for k in CATEGORIES[:3])
    sizes = [config.world_size * 2**k for k in range(1, 7) if config.world_size * 2**k <= MAX_WORLD_SIZE]
    if sizes and (config.world_size == 1 or unshardable <= budget):  # more ranks shrink only the sharded state
        report["tried"].append(" ".join([*flags, f"--world_size {sizes[0]} to {sizes[-1]}"]))
        more = _more_ranks(config, current, sizes, lambda peak: peak <= budget, log, progress)
        if more:
            W, peak, how = more
            return found([*flags, f"--world_size {W}"], config.replace(world_size=W), peak, how)
    for flag, candidate in _task_steps(config):
        report["tried"].append(" ".join([*flags, flag]))
        progress(f"estimating {' '.join([*flags, flag])}")
        estimated = est.estimate(candidate, progress)
        log(f"  trying {' '.join([*flags, flag])}: peak {estimated['peak']['total'] / GiB:.2f} GiB")
        if estimated["peak"]["total"] <= budget:
            return found([*flags, flag], candidate, estimated["peak"]["total"], "estimated")
    return report
