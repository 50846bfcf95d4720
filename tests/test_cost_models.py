"""CostTable, analytic roofline, memory model and profiled costs."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from crosscut.cost_models.analytic import analytic_costs, node_times
from crosscut.cost_models.cluster import Cluster
from crosscut.cost_models.devices import preset
from crosscut.cost_models.efficiency import efficiency_of
from crosscut.cost_models.memory import activation_bytes, peak_memory, resident_bytes, saved_by
from crosscut.cost_models.profiled import profile_costs
from crosscut.cost_models.table import CostTable, NodeCost
from crosscut.errors import CostModelError, InputError
from crosscut.ir.graph import OpGraph, OpNode

MB = 10**6


def _chain(flops: int = 10**9, params: int = 4 * MB) -> OpGraph:
    """x -> conv -> relu -> flatten -> linear -> output, built by hand."""
    nodes = [
        OpNode("x", "placeholder", "placeholder", "x", [], [[8, 3, 32, 32]], out_bytes=MB),
        OpNode("conv", "call_module", "conv2d", "conv", ["x"], out_bytes=8 * MB,
               param_bytes=params, fwd_flops=flops, bwd_flops=2 * flops, read_bytes=MB + params),
        OpNode("relu", "call_module", "relu", "relu", ["conv"], out_bytes=8 * MB,
               read_bytes=8 * MB),
        OpNode("flatten", "call_function", "flatten", "torch.flatten", ["relu"], out_bytes=8 * MB),
        OpNode("fc", "call_module", "linear", "fc", ["flatten"], out_bytes=MB // 10,
               param_bytes=params, fwd_flops=flops, bwd_flops=2 * flops, read_bytes=9 * MB),
        OpNode("output", "output", "output", "output", ["fc"]),
    ]  # fmt: skip
    g = OpGraph(nodes, batch_size=8, mode="train")
    g.lint()
    return g


def test_cost_table_round_trip_and_lookups() -> None:
    t = CostTable(
        {"a": NodeCost({"V100": 1e-3, "cpu": 5e-2}, {"V100": 2e-3, "cpu": 1e-1}, 100, 7),
         "b": NodeCost({"V100": 0.5e-3, "cpu": 1e-2}, {"V100": 1e-3, "cpu": 2e-2}, 0, 3)},
        source="profiled", meta={"k": [1, 2]},
    )  # fmt: skip
    again = CostTable.from_json(t.to_json())
    assert again == t
    assert t.node_time("a", "V100", training=True) == pytest.approx(3e-3)
    assert t.node_time("a", "V100", training=False) == pytest.approx(1e-3)
    assert t.total("cpu", "train") == pytest.approx(0.18)
    assert t.total("cpu", "infer") == pytest.approx(0.06)
    assert t.kinds == ["V100", "cpu"]
    assert t.resident_bytes("a") == 100 and t.activation_bytes("b") == 3
    with pytest.raises(CostModelError, match="no time for device kind"):
        t.fwd_s("a", "H100")
    with pytest.raises(CostModelError):
        t.fwd_s("zz", "cpu")
    with pytest.raises(CostModelError):
        CostTable.from_json('{"nodes": {"a": {"fwd": 1}}}')


def test_share_scales_say_how_much_slower_per_sample_a_share_runs() -> None:
    """time(s) / (time(b) · s / b) per node and kind, training time; kept through JSON
    and merges; nodes a smaller table lacks, or sizes not below the batch, get none."""
    full = CostTable(
        {"a": NodeCost({"V100": 1e-3}, {"V100": 2e-3}), "b": NodeCost({"V100": 1e-3}, {})}
    )
    half = CostTable({"a": NodeCost({"V100": 0.9e-3}, {"V100": 1.5e-3})})
    quarter = CostTable(
        {"a": NodeCost({"V100": 0.5e-3}, {"V100": 1e-3}), "b": NodeCost({"V100": 1e-3}, {})}
    )
    scaled = full.with_share_scales({16: half, 8: quarter, 32: full}, batch=32)
    assert scaled.batch_scale("a") == {
        "16": {"V100": pytest.approx(2.4e-3 / 1.5e-3)},
        "8": {"V100": pytest.approx(1.5e-3 / 0.75e-3)},
    }
    assert scaled.batch_scale("b") == {"8": {"V100": pytest.approx(4.0)}}
    assert full.batch_scale("a") == {}  # the original is left alone
    assert CostTable.from_json(scaled.to_json()) == scaled
    assert scaled.merge(full).batch_scale("a") == scaled.batch_scale("a")


def test_merge_keeps_both_kinds() -> None:
    g = _chain()
    a = analytic_costs(g, Cluster.from_spec("2xV100"))
    b = analytic_costs(g, Cluster.from_spec("2xcpu"))
    m = a.merge(b)
    assert m.kinds == ["V100", "cpu"]
    assert m.total("V100") == pytest.approx(a.total("V100"))


def test_analytic_monotone_in_flops_and_faster_devices() -> None:
    v100, k20 = Cluster.from_spec("1xV100"), Cluster.from_spec("1xK20c")
    prev = 0.0
    for flops in (10**8, 10**9, 10**10, 10**11):
        t = analytic_costs(_chain(flops), v100).node_time("conv", "V100", training=True)
        assert t > prev
        prev = t
    g = _chain(10**11)
    assert analytic_costs(g, k20).total("K20c") > analytic_costs(g, v100).total("V100")
    table = analytic_costs(g, v100)
    assert table.fwd_s("x", "V100") == 0.0 and table.fwd_s("output", "V100") == 0.0
    spec = preset("V100")
    eff = efficiency_of("V100")
    # compute-bound conv (no shapes: no size or depth ramp): flops / achieved + launch
    assert node_times(g, g.node("conv"), spec)[0] == pytest.approx(
        1e11 / (15.7e12 * eff.fma) + 5e-6
    )
    # memory-bound relu: bytes / achieved bandwidth; its backward moves twice the bytes
    f, b = node_times(g, g.node("relu"), spec)
    assert f == pytest.approx(16 * MB / (900e9 * eff.memory) + 5e-6)
    assert b == pytest.approx(32 * MB / (900e9 * eff.memory) + 5e-6)
    assert node_times(g, g.node("flatten"), spec) == (5e-6, 5e-6)  # a view moves nothing


def test_a_channel_shard_reads_its_whole_input_and_pays_its_launches() -> None:
    """One of ``w`` channel shards: the conv does 1/w of its FLOPs but reads its whole
    input and 1/w of its weights, the relu moves 1/w of its bytes, and each pays its
    whole launch overhead, so a shard costs more than 1/w of the node (the scale
    ``channel_scales`` records), more so the smaller the shard."""
    from crosscut.cost_models.analytic import channel_scales

    g = _chain(10**8)
    spec = preset("V100")
    eff = efficiency_of("V100")
    bw = 900e9 * eff.memory
    f, _ = node_times(g, g.node("relu"), spec, part=0.25)
    assert f == pytest.approx(16 * MB * 0.25 / bw + 5e-6)
    conv_f, _ = node_times(g, g.node("conv"), spec, part=0.5)
    whole_f, _ = node_times(g, g.node("conv"), spec)
    assert whole_f / 2 < conv_f < whole_f
    scales = channel_scales(g, Cluster.from_spec("2xV100"), [1, 2, 4])
    assert set(scales) == {"conv", "relu", "flatten", "fc"}  # every node with a time
    for name in ("conv", "relu", "fc"):
        two, four = scales[name]["2"]["V100"], scales[name]["4"]["V100"]
        assert 1.0 < two < four, (name, two, four)
    table = analytic_costs(g, Cluster.from_spec("2xV100")).with_channel_scales(scales)
    assert table.channel_share_scale("conv") == scales["conv"]
    assert CostTable.from_json(table.to_json()) == table


def test_infer_mode_has_no_backward_or_activations() -> None:
    g = _chain()
    g.mode = "infer"
    t = analytic_costs(g, Cluster.from_spec("1xV100"))
    assert all(t.bwd_s(n.name, "V100") == 0.0 for n in g.nodes)
    assert all(t.activation_bytes(n.name) == 0 for n in g.nodes)
    assert t.resident_bytes("conv") == 4 * MB  # params only


def test_resident_adam_vs_sgd() -> None:
    conv = _chain().node("conv")
    assert resident_bytes(conv, "train", "sgd") == 8 * MB  # params + grads
    assert resident_bytes(conv, "train", "momentum") == 12 * MB
    assert resident_bytes(conv, "train", "adam") == 16 * MB  # + two moments
    assert resident_bytes(conv, "infer", "adam") == 4 * MB
    with pytest.raises(InputError):
        resident_bytes(conv, "train", "lion")
    g = _chain()
    assert peak_memory(g, optimizer="adam") - peak_memory(g, optimizer="sgd") == 2 * 8 * MB


def test_saved_activations_rule() -> None:
    g = _chain()
    assert saved_by(g, g.node("conv")) == (["x"], 0)  # conv saves its input
    assert saved_by(g, g.node("relu")) == (["relu"], 0)  # relu saves its output
    assert saved_by(g, g.node("flatten")) == ([], 0)  # a view saves nothing
    acts = activation_bytes(g)
    # fc saves flatten, a view of relu's output, which relu saves too: counted once, at relu.
    assert acts == {"x": MB, "conv": 0, "relu": 8 * MB, "flatten": 0, "fc": 0, "output": 0}
    one = peak_memory(g, inflight_microbatches=1)
    four = peak_memory(g, inflight_microbatches=4)
    assert four - one == 3 * 9 * MB  # three more micro-batches of saved activations
    with pytest.raises(InputError):
        peak_memory(g, inflight_microbatches=0)
    sub = peak_memory(g, ["fc"])
    assert sub < one


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.relu(self.bn(self.conv(x))))
        out: torch.Tensor = self.fc(torch.flatten(y, 1) + 1.0)
        return out


def _traced(mode: str = "train") -> OpGraph:
    trace_mod = pytest.importorskip("crosscut.frontend.tracer")
    graph: OpGraph = trace_mod.trace(_Tiny(), torch.randn(4, 3, 16, 16), mode=mode)
    return graph


def test_memory_model_matches_mem_tracker() -> None:
    mt = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, x = _Tiny().train(), torch.randn(32, 3, 16, 16)
    trace_mod = pytest.importorskip("crosscut.frontend.tracer")
    graph = trace_mod.trace(model, x, mode="train")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = mt.MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            batch = x.clone()
            model(batch).sum().backward()
            opt.step()
            del batch
            if step == 0:
                tracker.reset_mod_stats()
    measured = sum(int(v["Total"]) for v in tracker.get_tracker_snapshot("peak").values())
    predicted = peak_memory(graph, grads_resident=False) + x.numel() * 4
    assert predicted == pytest.approx(measured, rel=0.15)


def _trust_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reuse cached profiles without re-timing them: a tiny graph's millisecond steps
    drift with the machine's load, and these tests are about the cache itself."""
    from crosscut.cost_models import profiled

    monkeypatch.setattr(profiled, "_still_holds", lambda *args: True)


def test_profiled_costs_cache_and_corrupt_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _trust_caches(monkeypatch)
    g = _traced()
    t1 = profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    assert t1.source == "profiled" and t1.meta["cache_hit"] is False
    assert t1.fwd_s("conv", "cpu") > 0 and t1.bwd_s("conv", "cpu") > 0
    assert t1.bwd_s("fc", "cpu") > 0
    assert t1.fwd_s("x", "cpu") == 0.0
    assert t1.resident_bytes("conv") == 2 * g.node("conv").param_bytes + g.node("conv").buffer_bytes
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    t2 = profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    assert t2.meta["cache_hit"] is True
    assert t2.fwd_s("conv", "cpu") == t1.fwd_s("conv", "cpu")
    files[0].write_text("{ this is not json")
    with pytest.warns(RuntimeWarning, match="ignoring unreadable cost cache"):
        t3 = profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    assert t3.meta["cache_hit"] is False and t3.fwd_s("conv", "cpu") > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile_costs(g, "cpu", cache_dir=tmp_path).meta["cache_hit"] is True


def test_profiled_costs_infer_and_errors(tmp_path: Path) -> None:
    g = _traced("infer")
    t = profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=None, kind="cpu-test")
    assert t.kinds == ["cpu-test"]
    assert all(t.bwd_s(n.name, "cpu-test") == 0.0 for n in g.nodes)
    bare = _chain()
    with pytest.raises(CostModelError, match="GraphModule"):
        profile_costs(bare, "cpu", cache_dir=tmp_path)


def test_in_context_and_isolated_methods(tmp_path: Path) -> None:
    g = _traced()
    ctx = profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=tmp_path)
    iso = profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=tmp_path, method="isolated")
    assert ctx.meta["method"] == "context" and iso.meta["method"] == "isolated"
    assert len(list(tmp_path.glob("*.json"))) == 2  # cached apart
    for table in (ctx, iso):
        assert table.fwd_s("conv", "cpu") > 0 and table.bwd_s("conv", "cpu") > 0
        assert table.bwd_s("fc", "cpu") > 0
    with pytest.raises(CostModelError, match="context"):
        profile_costs(g, "cpu", cache_dir=None, method="guess")


def test_a_profile_records_how_far_its_whole_steps_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy search reads the spread to know which predictions it cannot tell apart."""
    _trust_caches(monkeypatch)
    from crosscut.cost_models.context import measure_in_context
    from crosscut.cost_models.profiled import step_spread

    assert step_spread([]) == 0.0 and step_spread([2.0]) == 0.0
    assert step_spread([1.0, 1.5, 2.0]) == pytest.approx(0.5 / 1.5 * 2)
    g = _traced()
    steps: list[float] = []
    assert g.gm is not None
    x = torch.randn(g.node("x").shapes[0])
    times = measure_in_context(g.gm, [x], torch.device("cpu"), True, 1, 3, steps)
    assert len(steps) == 3 and all(s > 0 for s in steps)
    # a whole step holds every node's forward and backward interval (and the interpreter's
    # own time around them, most of a step on a model this small)
    total = sum(f + b for f, b in times.values())
    assert 0 < total <= max(steps) * 1.5
    table = profile_costs(g, "cpu", repeats=3, warmup=1, cache_dir=tmp_path)
    assert table.meta["spread"] >= 0.0
    cached = profile_costs(g, "cpu", repeats=3, warmup=1, cache_dir=tmp_path)
    assert cached.meta["cache_hit"] and cached.meta["spread"] == table.meta["spread"]
    # the noisier profile counts, whichever side it is on (the measured spread can be large
    # on a loaded machine: the other's is set above it, not to a fixed figure)
    noisier = table.meta["spread"] + 9.0
    other = CostTable(table.nodes, "profiled", table.mode, table.optimizer, {"spread": noisier})
    assert table.merge(other).meta["spread"] == noisier == other.merge(table).meta["spread"]
    quieter = CostTable(table.nodes, "profiled", table.mode, table.optimizer, {"spread": 0.0})
    assert table.merge(quieter).meta["spread"] == table.meta["spread"]


def test_backward_intervals_tile_the_pass() -> None:
    from crosscut.cost_models.context import _backward_times, _Clock

    stamps = [(1.0, "c"), (2.0, "b"), (2.5, "c2"), (3.5, "a")]  # in the order the hooks ran
    times = _backward_times(_Clock(torch.device("cpu")), stamps, end=4.0)
    assert times == {"c": 1.0, "b": 0.5, "c2": 1.0, "a": 0.5}
    assert sum(times.values()) == pytest.approx(4.0 - 1.0)


def test_a_host_bound_profile_is_scaled_to_the_plain_step() -> None:
    """On a GPU the interpreter and hooks can leave the device waiting, inflating every
    interval: node times that sum past an uninstrumented step are scaled down to it,
    all alike; times that fit are kept. ``plain=True`` runs that path on the CPU."""
    from crosscut.cost_models.context import host_bound, measure_in_context

    times = {"a": (1.0, 2.0), "b": (0.5, 0.5)}
    assert host_bound(times, 8.0) == times
    scaled = host_bound(times, 2.0)
    assert sum(f + b for f, b in scaled.values()) == pytest.approx(2.0)
    assert scaled["a"][1] / scaled["b"][0] == pytest.approx(4.0)  # shares kept
    g = _traced()
    assert g.gm is not None
    x = torch.randn(g.node("x").shapes[0])
    steps: list[float] = []
    got = measure_in_context(g.gm, [x], torch.device("cpu"), True, 1, 3, steps, plain=True)
    assert len(steps) == 3 and all(s > 0 for s in steps)  # the plain steps
    assert sum(f + b for f, b in got.values()) <= statistics.median(steps) * (1 + 1e-9)
    assert all(f >= 0 and b >= 0 for f, b in got.values())


def test_profiling_keeps_no_copy_of_the_model_alive(tmp_path: Path) -> None:
    """The gradient hooks once held the interpreter, whose environment held the graph's
    tensors: a cycle through autograd's C++ nodes that no collection frees. Each
    profile kept its device copy of the model, and on an H100 the fourth ResNet-50
    profile of one process ran out of memory."""
    import gc

    def copies() -> int:
        gc.collect()
        return sum(isinstance(o, fx.GraphModule) for o in gc.get_objects())

    g = _traced()
    before = copies()
    profile_costs(g, "cpu", repeats=2, warmup=1, cache_dir=None)  # forward, backward, split
    assert copies() == before


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, 1e300])
def test_a_cached_profile_with_impossible_times_is_refused_naming_the_file(
    bad: float, tmp_path: Path
) -> None:
    """NaN, negative or absurd cached times: warned about by file and node, then re-profiled."""
    g = _traced()
    profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    data["nodes"]["conv"]["fwd"]["cpu"] = bad
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match=rf"{path.name}.*'conv' has fwd time"):
        again = profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=tmp_path)
    assert again.meta["cache_hit"] is False
    assert 0 < again.fwd_s("conv", "cpu") < 1  # measured again, not the cached value


def test_a_cached_profile_is_retimed_and_profiled_again_when_the_machine_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written while the machine was busy (its steps 30x slower than now) must not be
    compared with fresh prices: it is re-timed on reuse, found stale and profiled again."""
    g = _traced()
    first = profile_costs(g, "cpu", repeats=3, warmup=1, cache_dir=tmp_path)
    assert len(first.meta["steps"]) == 3
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    # 30x: beyond any noise a step of a few milliseconds shows (3x once held within it)
    data["meta"]["steps"] = [30.0 * s for s in data["meta"]["steps"]]
    data["meta"]["spread"] = 0.0
    for cost in data["nodes"].values():
        cost["fwd"]["cpu"] *= 30.0
    path.write_text(json.dumps(data))
    # the re-timing sees the machine as it is now: steady steps at the first profile's
    # median (patched in: three real steps of a millisecond on a loaded 2-core machine can
    # spread so far that 3x their spread covers even 30x, and the check rightly abstains)
    from crosscut.cost_models import profiled

    real = profiled._measure_context
    now = sorted(first.meta["steps"])[1]
    calls = []

    def steady_recheck(graph, dev, warmup, repeats, steps=None):  # type: ignore[no-untyped-def]
        calls.append(repeats)
        if len(calls) == 1 and steps is not None:  # the re-timing of the cached profile
            steps.extend([now] * repeats)
            return {}
        return real(graph, dev, warmup=warmup, repeats=repeats, steps=steps)

    monkeypatch.setattr(profiled, "_measure_context", steady_recheck)
    with pytest.warns(RuntimeWarning, match=r"profiled at .* now takes .*profiling again"):
        again = profile_costs(g, "cpu", repeats=3, warmup=1, cache_dir=tmp_path)
    assert len(calls) >= 2  # re-timed, then profiled again for real
    assert again.meta["cache_hit"] is False
    assert again.meta["steps"] != data["meta"]["steps"]
    # the fresh profile says why it was taken: the re-timing that rejected the cache
    assert again.meta["recheck"]["steps"] == [now] * 3
    ratio, tolerance = again.meta["recheck"]["ratio"], again.meta["recheck"]["tolerance"]
    assert ratio == pytest.approx(1 / 30, rel=0.5) and 1 / ratio - 1 > tolerance
    # the machine as it was: re-timed steps equal to the cached ones reuse the cache
    # (the steps are patched in: real ones of a millisecond drift with the machine's load)

    def same_steps(graph, dev, warmup, repeats, steps=None):  # type: ignore[no-untyped-def]
        steps.extend(again.meta["steps"])
        return {}

    monkeypatch.setattr(profiled, "_measure_context", same_steps)
    reused = profile_costs(g, "cpu", repeats=3, warmup=1, cache_dir=tmp_path)
    assert reused.meta["cache_hit"] is True
    assert reused.meta["recheck"]["ratio"] == pytest.approx(1.0)
    assert reused.fwd_s("conv", "cpu") == again.fwd_s("conv", "cpu")


def test_a_cached_profile_without_steps_cannot_be_checked_and_is_measured_again(
    tmp_path: Path,
) -> None:
    g = _traced()
    profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    del data["meta"]["steps"]
    path.write_text(json.dumps(data))
    assert (
        profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=tmp_path).meta["cache_hit"] is False
    )


def test_the_cache_key_holds_the_thread_count_a_cpu_profile_ran_on() -> None:
    from crosscut.cost_models.profiled import cache_key

    g = _traced()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cache_key(g, "cpu", torch.device("cpu"))
        torch.set_num_threads(2)
        two = cache_key(g, "cpu", torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert one != two


def test_a_bf16_profile_is_retimed_under_the_autocast_it_was_taken_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-timed in fp32, a bf16 profile's steps would never match its cached ones, and
    every reuse would profile the graph again."""
    from crosscut.cost_models import profiled
    from crosscut.frontend.tracer import trace

    g = trace(_Tiny(), torch.randn(4, 3, 16, 16), precision="bf16")
    profile_costs(g, "cpu", repeats=1, warmup=0, cache_dir=tmp_path)
    seen: list[bool] = []

    def record(graph, dev, warmup, repeats, steps=None):  # type: ignore[no-untyped-def]
        seen.append(torch.is_autocast_enabled("cpu"))
        steps.append(1.0)
        return {}

    monkeypatch.setattr(profiled, "_measure_context", record)
    with pytest.warns(RuntimeWarning, match="profiling again"):  # 1 s: moved
        cached = profiled._load_cache(next(tmp_path.glob("*.json")), g)
        assert cached is not None
        profiled._still_holds(cached, g, torch.device("cpu"), None)
    assert seen == [True]


def test_every_priced_optimizer_is_accepted_by_the_front_doors() -> None:
    """An optimizer the memory and update tables price can be asked for, and round-trips.

    Why: ``rmsprop`` was priced (EfficientNet's calibration points use it) but
    refused by ``partition``, the CLI and the plan schema, which each kept
    their own list.
    """
    import crosscut
    from crosscut.cli.commands import build_parser
    from crosscut.cost_models.efficiency import _UPDATE_BYTES
    from crosscut.cost_models.memory import OPTIMIZER_STATE
    from crosscut.ir.plan import Plan, plan_schema
    from crosscut.options import OPTIMIZERS

    assert set(OPTIMIZERS) == set(OPTIMIZER_STATE) == set(_UPDATE_BYTES)
    schema = plan_schema()["properties"]["options"]["properties"]["optimizer"]["enum"]
    assert set(schema) == set(OPTIMIZERS)
    x = torch.randn(4, 3, 8, 8)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    resident = {}
    for name in OPTIMIZERS:
        args = build_parser().parse_args(
            ["partition", "m:f", "--devices", "1xV100", "-o", "p.json", "--optimizer", name]
        )
        assert args.optimizer == name
        plan = Plan.from_json(crosscut.partition(model, "1xV100", x, optimizer=name).to_json())
        assert plan.options.optimizer == name
        resident[name] = sum(n.resident_bytes for n in plan.nodes)
    assert resident["sgd"] < resident["momentum"] < resident["rmsprop"] == resident["adam"]
