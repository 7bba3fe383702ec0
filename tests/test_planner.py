"""The planner: its counts against what the benchmarks counted, its choices and refusals, the tuned configurations
(present for every preset, GPU count and profile, and what the planner would choose), the flags that replace them,
``paradit plan``'s output, and its predictions against every multi-GPU step measured on H200s."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from functools import cache

import pytest

from benchmarks import tune_configs, validate_planner
from benchmarks.common import default_plan_for
from benchmarks.model_facts import preset_facts
from paradit import cli, machine
from paradit.errors import InvalidRequest
from paradit.families import FAMILIES, PRESETS
from paradit.family import FACTS_FILE
from paradit.options import PLACEMENTS
from paradit.parallel.config import ParallelConfig
from paradit.parallel.validate import check_plan
from paradit.planner import choose
from paradit.planner.cost import attention_ms, step_cost
from paradit.planner.measurements import all_measurements
from paradit.planner.plan import MemoryEstimates, calibration, facts_for, plan, request_for
from paradit.planner.probe import collective_gbps
from paradit.planner.profile import all_profiles, load_profile
from paradit.planner.tuned import GPU_COUNTS, tuned_entry
from paradit.request import GenerationRequest
from paradit.settings import choices
from tests.checkpoint_cache import cached, copy_of
from tests.checkpoints import build_klein_checkpoint
from tests.test_cli import assert_one_line_error, run_cli

MIB = 2**20


@cache
def planned(model: str, gpus: int, profile: str):
    return plan(PRESETS[model], gpus, load_profile(profile))


def sent_mib(model: str, parallel: ParallelConfig, batch: int) -> float:
    spec, facts = PRESETS[model], facts_for(PRESETS[model])
    workload = facts.workload(spec.height, spec.width, None)
    cost = step_cost(facts, workload, batch, parallel, False, load_profile("h200-nvlink"), 0.7, True)
    return cost.bytes_sent / MIB


def test_facts_give_the_flops_and_the_bytes_the_benchmarks_counted():
    facts = facts_for(PRESETS["flux2-dev"])
    workload = facts.workload(1024, 1024, None)
    linear = sum(group.flops.at(workload.image_tokens, workload.text_tokens) for group in facts.linear)
    attention = sum(
        4 * g.layers * g.heads * g.head_dim * g.query_tokens.at(4096, 512) * g.key_tokens.at(4096, 512)
        for g in facts.attention
    )
    assert (linear + attention) / 1e12 == pytest.approx(282.599551401984, rel=1e-9)  # shared/models/configs.json
    # "MiB sent/step" of rank 0 in docs/benchmarks.md, counted by paradit's collectives on H200s.
    assert sent_mib("flux2-dev", ParallelConfig(ulysses=2), 1) == pytest.approx(3024, abs=1)
    assert sent_mib("flux2-dev", ParallelConfig(ring=2), 1) == pytest.approx(3024, abs=1)
    assert sent_mib("flux2-dev", ParallelConfig(tensor=2), 1) == pytest.approx(3456, abs=1)
    assert sent_mib("flux2-dev", ParallelConfig(pipefusion=2, patches=2), 1) == pytest.approx(54, abs=1)
    assert sent_mib("qwen-image", ParallelConfig(ulysses=2), 2) == pytest.approx(3060, abs=1)
    assert sent_mib("z-image-turbo", ParallelConfig(ulysses=2), 1) == pytest.approx(1020, abs=1)
    assert sent_mib("sd3.5-large", ParallelConfig(ring=2), 2) == pytest.approx(1562, abs=1)


@pytest.mark.parametrize("preset", ["flux2-tiny", "qwen-image-tiny", "sd3.5-tiny", "z-image-tiny", "wan-tiny"])
def test_model_facts_json_is_what_a_fresh_meta_device_trace_counts(preset):
    folder = FAMILIES[PRESETS[preset].family].measured.folder
    stored = json.loads((folder / FACTS_FILE).read_text())["models"][preset]
    assert json.loads(json.dumps(preset_facts(PRESETS[preset]))) == stored


def test_without_peer_access_flux2_dev_pipelines_and_with_nvlink_it_stays_exact():
    pcie = planned("flux2-dev", 2, "h200-p2p-off")
    assert pcie.best.parallel == ParallelConfig(pipefusion=2, patches=2)
    ulysses = next(o for o in pcie.ranked if o.parallel == ParallelConfig(ulysses=2))
    assert ulysses.cost.bytes_sent / 2**30 == pytest.approx(2.95, abs=0.01)  # 3.0 GiB of all-to-alls a step
    assert ulysses.mean_ms > 1.3 * pcie.best.mean_ms
    nvlink = planned("flux2-dev", 2, "h200-nvlink")
    assert nvlink.best.parallel.exact and nvlink.best.parallel.pipefusion == 1 and not nvlink.best.fp8


def test_guidance_branches_go_to_cfg_parallel_even_without_peer_access():
    choice = planned("z-image", 2, "h200-p2p-off")
    assert choice.request.uses_cfg and choice.best.parallel == ParallelConfig(cfg=2)
    assert choice.best.cost.bytes_sent < MIB  # one exchange of the prediction a step


def test_fp8_only_when_nothing_fits_without_it():
    small = planned("qwen-image", 1, "r9700s-pcie")
    assert small.best.fp8 and small.fp8_needed and small.best.memory.total <= 32 * 2**30
    assert not planned("qwen-image", 1, "h200-nvlink").best.fp8


def test_nothing_fits_is_refused_with_the_numbers():
    with pytest.raises(InvalidRequest) as refusal:
        planned("flux2-dev", 1, "r9700s-pcie")
    message = str(refusal.value)
    assert "fits no plan on 1 x 32.0 GiB" in message
    assert "1 GPU + FP8 with the text encoders offload, needs 34.5 GiB on rank 0 (transformer weights 30.8" in message


@pytest.mark.parametrize("profile", list(all_profiles()))
def test_tuned_entries_cover_every_preset_and_gpu_count_and_can_run(profile):
    for preset, spec in PRESETS.items():
        for gpus in GPU_COUNTS:
            entry = tuned_entry(preset, gpus, profile)
            assert entry is not None, (preset, gpus)
            if entry.refused:
                assert "GiB" in entry.refused and all_profiles()[profile].memory_gib < 100
                continue
            assert entry.parallel.world_size == gpus
            check_plan(FAMILIES[spec.family], spec, entry.parallel)
            assert entry.text_encoder_placement in PLACEMENTS and entry.quantize in ("none", "fp8")
            assert not (entry.cuda_graphs and entry.parallel.pipefusion > 1)
            if entry.measured:
                assert not all_profiles()[profile].predicted
                assert {"ms_per_step", "section", "date", "where", "command"} <= set(entry.source)
            else:
                assert entry.source["kind"] == "predicted" and entry.ms_per_step is not None


def test_tuned_entries_are_the_planners_choice_and_cite_measurements():
    spec = PRESETS["flux2-klein-4b"]
    memory = MemoryEstimates(spec)
    for profile in all_profiles().values():
        assert tune_configs.entry(spec, 2, profile, memory) == tuned_entry(spec.name, 2, profile.name)
    measured = tuned_entry("sd3.5-large", 2, "h200-nvlink")
    assert measured.parallel == ParallelConfig(cfg=2) and measured.cuda_graphs
    assert measured.source["ms_per_step"] == 67.1 and "parallel_step.py" in measured.source["command"]


def generate_args(*extra: str):
    return cli.build_parser().parse_args(["generate", "--model", "flux2-dev", "--prompt", "a", *extra])


def test_gpus_alone_runs_the_tuned_entry_and_each_flag_replaces_its_part(monkeypatch):
    monkeypatch.setattr(machine, "detect_profile", lambda gpus: load_profile("h200-p2p-off"))
    spec = PRESETS["flux2-dev"]
    request = FAMILIES[spec.family].resolve_request(spec, GenerationRequest(prompt="a"))

    def settings(*extra: str):
        asked = dataclasses.replace(cli.asked_for(generate_args("--gpus", "2", *extra), "generate"), model=spec)
        return choices(asked, spec, request, machine.Machine(2))

    parallel, options, placement, origin = settings()
    assert parallel == ParallelConfig(pipefusion=2, patches=2) and not options.cuda_graphs
    assert options.quantize == "none" and placement == "gpu"
    assert "tuned configuration for flux2-dev on 2 x h200-p2p-off: pipefusion 2" in origin
    assert "measured 252.9" in origin
    assert settings("--patches", "4")[0] == ParallelConfig(pipefusion=2, patches=4)
    parallel, options, placement, _ = settings("--quantize", "fp8", "--text-encoder-placement", "offload")
    assert parallel.pipefusion == 2 and options.quantize == "fp8" and placement == "offload"
    assert settings("--ulysses", "2")[0] == ParallelConfig(ulysses=2)
    assert settings("--ulysses", "2")[3] is None  # the flags' plan: no tuned configuration announced
    assert settings("--device", "cpu")[0] == ParallelConfig(ulysses=2)  # CPU processes: the engine's default


def test_default_plan_for_follows_the_planner_on_a_known_gpu_only(monkeypatch):
    monkeypatch.setattr(machine, "detect_profile", lambda gpus: load_profile("h200-p2p-off"))
    assert default_plan_for(PRESETS["flux2-dev"], 2) == ParallelConfig(pipefusion=2, patches=2)
    assert default_plan_for(PRESETS["flux2-dev"], 2, device="cpu") == ParallelConfig(ulysses=2)
    monkeypatch.setattr(machine, "detect_profile", lambda gpus: None)
    assert default_plan_for(PRESETS["flux2-dev"], 2) == ParallelConfig(ulysses=2)


def test_a_request_unlike_the_entrys_is_planned_afresh():
    other = GenerationRequest(prompt="a", height=512, width=512)
    settings = choose.settings_for(PRESETS["flux2-dev"], 2, other, profile=load_profile("h200-p2p-off"))
    assert settings.origin.startswith("planned for this request on 2 x h200-p2p-off")
    assert request_for(PRESETS["flux2-dev"], other).height == 512


def test_a_checkpoint_uses_its_presets_counts_and_an_uncounted_architecture_keeps_the_default():
    tiny = PRESETS["flux2-tiny"]
    folder = dataclasses.replace(tiny, name="/ckpt/tiny", transformer={**tiny.transformer, "_class_name": "x"})
    assert facts_for(folder) is facts_for(tiny)
    other = dataclasses.replace(tiny, name="/ckpt/other", transformer={**tiny.transformer, "num_layers": 3})
    assert choose.settings_for(other, 2, profile=load_profile("h200-nvlink")) is None
    with pytest.raises(InvalidRequest, match="no FLOP counts for /ckpt/other"):
        plan(other, 2, load_profile("h200-nvlink"))


def test_plan_command_takes_a_checkpoint_folder_of_a_presets_architecture(capsys, tmp_path):
    """A folder written by diffusers' save_pretrained, its transformer flux2-tiny's: planned with that preset's
    counts. One of an architecture no preset has runs the default plan, and the plan says why."""
    from diffusers import Flux2Transformer2DModel

    folder = copy_of(cached(build_klein_checkpoint), tmp_path / "ckpt")
    capsys.readouterr()  # a first build's progress bars
    argv = ["plan", "--model", str(folder), "--gpus", "2", "--profile", "h200-nvlink"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "no FLOP counts for" in out and "default" in out and "Run it: paradit generate" in out
    shutil.rmtree(folder / "transformer")
    Flux2Transformer2DModel(**PRESETS["flux2-tiny"].transformer).save_pretrained(folder / "transformer")
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    assert any(line.startswith(f"{folder} on 2 x h200-nvlink") for line in out.splitlines())
    assert "Run it: paradit generate" in out


def test_plan_command_shows_the_winner_the_runners_up_and_why(capsys):
    code, out, err = run_cli(["plan", "--model", "flux2-dev", "--gpus", "2", "--profile", "h200-p2p-off"], capsys)
    assert code == 0 and err == ""
    rows = [line for line in out.splitlines() if line[:2] in ("* ", "  ", "x ", "1 ") and "ms/step" not in line]
    assert rows[0].startswith("* pipefusion 2 (2 patches") and "54 MiB" in rows[0]
    assert any(row.lstrip().startswith("ulysses 2") and "3.0 GiB" in row for row in rows)
    assert "ulysses 2 computes" in out and "sends 3.0 GiB per step" in out and "at 26.1 GB/s (all-to-all)" in out
    assert "Run it: paradit generate --model flux2-dev --gpus 2 --pipefusion 2 --patches 2 --warmup-steps 1" in out


def test_plan_command_refusals_are_one_line_with_the_numbers(capsys):
    code, _, err = run_cli(["plan", "--model", "flux2-dev", "--gpus", "1", "--profile", "r9700s-pcie"], capsys)
    assert_one_line_error(code, err, "does not fit under the 32.0 GiB free on an r9700s-pcie GPU", "use --quantize fp8")
    code, _, err = run_cli(["plan", "--model", "flux2-dev", "--gpus", "2", "--height", "1000"], capsys)
    assert_one_line_error(code, err, "height 1000 is not allowed")
    code, _, err = run_cli(["plan", "--model", "flux2-dev", "--gpus", "2", "--profile", "a100"], capsys)
    assert_one_line_error(code, err, "unknown hardware profile", "h200-nvlink")


def test_predictions_against_every_multi_gpu_step_measured_on_h200s():
    rows = validate_planner.predictions()
    measured = [m for m in all_measurements() if m.parallel.world_size > 1 and m.superseded is None]
    assert len(rows) == len(measured)
    cases = validate_planner.cases(rows)
    independent = [case for case in cases if not case.in_sample]
    print(validate_planner.markdown())
    assert len(independent) >= 10 and sum(case.hit for case in independent) >= 0.9 * len(independent)
    assert sum(case.hit for case in cases) >= 0.9 * len(cases)
    assert sum(abs(row.error) <= validate_planner.WITHIN_PREDICTION for row in rows) >= 0.85 * len(rows)


def test_profiles_say_where_each_figure_comes_from():
    for profile in all_profiles().values():
        assert {"matmul_tflops", "linear_efficiency", "attention_tflops", "link_gbps", "host_ms_per_block"} <= {
            key.split(".")[0] for key in profile.sources
        }
    assert all_profiles()["r9700s-pcie"].predicted and not all_profiles()["h200-nvlink"].predicted
    h200 = load_profile("h200-nvlink")
    for fp8, precision in ((False, "bf16"), (True, "fp8")):
        own = [calibration(facts_for(PRESETS[name]), h200, fp8, True) for name in PRESETS]
        by_model = {c.source.model: c.efficiency for c in own if c.source and c.source.execution == "graphs"}
        assert len(by_model) == 5
        assert h200.linear_efficiency[precision] == pytest.approx(statistics.median(by_model.values()), abs=0.005)


def test_the_probe_times_every_collective_between_processes():
    rates = collective_gbps(2, "cpu", nbytes=MIB)
    assert set(rates) == {"all_to_all", "send_recv", "all_reduce", "all_gather"}
    assert all(rate > 0 for rate in rates.values())


def test_the_planner_weighs_swapped_experts_and_settings_apply_them():
    """On 2 x 32 GB cards Wan 2.2 A14B at 720p fitted no plan: both experts were counted resident."""
    profile = load_profile("r9700s-pcie")
    request = GenerationRequest(prompt="a", height=720, width=1280, frames=81)
    choice = plan(PRESETS["wan2.2-t2v-a14b"], 2, profile, request)
    assert choice.best.swap_experts and not choice.best.cuda_graphs and not choice.best.fp8  # exact first
    assert choice.best.memory.total <= profile.memory_bytes and any("--swap-experts" in n for n in choice.notes)
    swapped = choose.settings_for(PRESETS["wan2.2-t2v-a14b"], 1, profile=profile)  # the tuned entry: FP8 + swap
    assert swapped.swap_experts and swapped.quantize == "fp8" and not swapped.cuda_graphs
    assert not choose.settings_for(PRESETS["flux2-klein-4b"], 1, profile=profile).swap_experts


def test_input_images_lengthen_the_planned_step_as_measured():
    """FLUX.2-dev at 1024² (FP8, one H200) with 0, 1 and 3 references of 1024²: the planner counts their tokens in
    every block's sequence and in the memory estimate. Measured (docs/benchmarks.md, "Editing with reference images",
    session 11): 285.4, 603.9 and 1469.9 ms a step; the predictions are within 10%."""
    from PIL import Image

    profile = load_profile("h200-nvlink")
    measured = {0: 285.4, 1: 603.9, 3: 1469.9}
    chosen = {}
    for count in measured:
        request = GenerationRequest(
            prompt="a", height=1024, width=1024, image=[Image.new("RGB", (1024, 1024))] * count or None
        )
        chosen[count] = plan(PRESETS["flux2-dev"], 1, profile, request, quantize="fp8").best
        assert chosen[count].mean_ms == pytest.approx(measured[count], rel=0.1), count
    assert chosen[0].memory.total < chosen[1].memory.total < chosen[3].memory.total


def test_fp8_attention_is_predicted_at_its_measured_rate_above_the_crossover_only():
    """Wan 720p's self-attention (75,600 keys) moves to the FP8 kernel's 777 TFLOP/s, its text cross-attention (512
    keys) stays at SDPA's; under Ring 2 each block still has 37,800 keys. FLUX.2-dev at 1024² (4,608 keys) never uses
    the kernel; it loses its CUDA graphs, which FP8 attention does not combine with."""
    h200 = load_profile("h200-nvlink")
    wan = PRESETS["wan2.2-t2v-a14b"]
    request = GenerationRequest(prompt="a", height=720, width=1280, frames=81)
    sdpa, fp8 = (plan(wan, 1, h200, request, "fp8", attention=attention).best for attention in ("sdpa", "fp8"))
    facts = facts_for(wan)
    workload = facts.workload(720, 1280, 81)
    self_attention = next(g for g in facts.attention if g.key_tokens.at(workload.image_tokens, 0) > 10_000)
    saved = self_attention.flops(workload) * 2 * (1 / 594 - 1 / 777) / 1e9  # both guidance branches, ms
    assert sdpa.cost.compute_ms - fp8.cost.compute_ms == pytest.approx(saved, rel=1e-6)
    assert fp8.fp8_attention and not fp8.cuda_graphs
    ring = plan(wan, 2, h200, request, "fp8", attention="fp8").ranked
    ring2 = next(o for o in ring if o.parallel == ParallelConfig(ring=2))
    assert (
        ring2.cost.compute_ms
        < next(
            o for o in plan(wan, 2, h200, request, "fp8").ranked if o.parallel == ParallelConfig(ring=2)
        ).cost.compute_ms
    )
    flux, flux_facts = PRESETS["flux2-dev"], facts_for(PRESETS["flux2-dev"])
    flux_workload = flux_facts.workload(1024, 1024, None)
    kernel, exact = (attention_ms(flux_facts, flux_workload, 1, h200, fp8_attention) for fp8_attention in (True, False))
    assert kernel == exact > 0
    assert not plan(flux, 1, h200, attention="fp8").best.cuda_graphs
    with pytest.raises(InvalidRequest, match="r9700s-pcie has no measured FP8 attention rate"):
        plan(wan, 1, load_profile("r9700s-pcie"), request, "fp8", attention="fp8")
