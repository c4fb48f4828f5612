"""``rollout.engine: vllm`` against Hugging Face generate, on the shipped digit task's SFT policy (a micro Llama
with 64-wide heads: vLLM's CPU attention refuses head_dim 16). Run in the vLLM virtualenv (.ci/vllm_env);
skipped where vllm is not installed. The in-process tests share ONE engine: the process-wide engine of
``rollout/vllm_engine.py`` (built in about 20-40 s on 2 cores), which the in-process GRPO run reuses too; the
DDP, ``alignkit generate`` and server tests start processes of their own (an engine each).

* greedy completions equal HF generate's for the same weights and prompts;
* after an optimizer step (full fine-tuning, and LoRA with its adapters merged on the way) they equal HF's
  from the updated weights, and differ from the ones before the step (the weights really moved in); before the
  step's weights are pushed (``sync_weights``) the engine refuses to generate;
* sampled completions: one request with n samples per prompt group, and the engine's log-probs of the
  sampled tokens equal the trainer's forward at the sampling temperature (importance ratio ~1);
* GRPO with ``engine: vllm`` learns the digit task (the online learning test's threshold), in one process,
  under 2-process DDP and against an ``alignkit vllm-serve`` process (server mode);
* ``alignkit generate --engine vllm`` writes HF's greedy completions.

Measured (2 CPU cores shared with other jobs, seed 0, 60 iterations of 64 completions, reward_mean of the
10-iteration windows): engine hf 0.078 -> 0.222; vllm in one process 0.114 -> 0.261 (rise 0.115); 2-process
DDP 0.094 -> 0.231; against a vllm-serve process 0.111 -> 0.314. The threshold is the online learning test's.
The whole file: 2.3-4 minutes (the SFT policy about 30 s, the shared engine about 15-40 s).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from alignkit.models.tiny import build_tiny_model
from alignkit.rollout.engine import HFEngine, SamplingParams, generate_once
from alignkit.rollout.vllm_engine import VLLMConfig, VLLMEngine
from tests.conftest import assert_ok, run_cli

pytestmark = pytest.mark.vllm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MAX_LEN = 64 + 8  # configs/grpo.yaml: data.max_length + rollout.max_new_tokens (the run's engine is this one)
MIN_RISE = 0.035  # tests/integration/test_online_learning.py


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digit task's SFT policy (configs/sft_digits.yaml) on the micro64 Llama."""
    base = build_tiny_model(tmp_path_factory.mktemp("models") / "micro64", size="micro64", seed=0)
    out = tmp_path_factory.mktemp("sft_digits")
    assert_ok(run_cli(["train", str(CONFIGS / "sft_digits.yaml"), f"model.name_or_path={base}", f"output_dir={out}",
                       "logging.plot=false"], timeout=600))
    return out / "final"


@pytest.fixture(scope="module")
def setup(policy: Path) -> tuple[Any, Any, list[list[int]]]:
    """(tokenizer, HF model in float32, tokenized eval prompts of the digit task)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.resources import resource_path

    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    rows = [json.loads(x) for x in resource_path("digits_prompts_eval.jsonl").read_text().splitlines()[:12]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in rows]
    return tok, model, [list(p) for p in prompts]


@pytest.fixture(scope="module")
def engine(setup: tuple[Any, Any, list[list[int]]]) -> VLLMEngine:
    return VLLMEngine(setup[0], VLLMConfig(), MAX_LEN)


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def both(engine: VLLMEngine, hf: HFEngine, model: Any, prompts: list[list[int]]) -> tuple[Any, Any]:
    return generate_once(engine, model, prompts, GREEDY), generate_once(hf, model, prompts, GREEDY)


def test_greedy_equals_hf_generate(setup: tuple[Any, Any, list[list[int]]], engine: VLLMEngine) -> None:
    tok, model, prompts = setup
    prompts = prompts + [prompts[0], prompts[0]]  # repeated prompts: greedy requests are not grouped (vLLM: n = 1)
    v, h = both(engine, HFEngine(tok), model, prompts)
    assert v.completion_ids == h.completion_ids
    assert v.finish_reasons == h.finish_reasons and v.texts == h.texts
    assert "stop" in v.finish_reasons  # the SFT policy ends its answers with EOS (kept, as HF's)
    assert not engine.sync_weights(model)  # unchanged weights are not pushed again


def lm_step(model: Any, prompts: list[list[int]], lr: float) -> None:
    """One AdamW step of next-token loss on the prompts followed by a fixed wrong answer."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    ids = torch.tensor([p + [5, 6, 7] for p in prompts if len(p) == len(prompts[0])])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_greedy_equal_after_an_optimizer_step(setup: tuple[Any, Any, list[list[int]]], engine: VLLMEngine,
                                              lora: bool) -> None:
    tok, base, prompts = setup
    model = copy.deepcopy(base)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj",
                                                                                      "down_proj"], lora_dropout=0.0))
    hf = HFEngine(tok)
    before, h0 = both(engine, hf, model, prompts)
    assert before.completion_ids == h0.completion_ids
    lm_step(model, prompts, lr=3e-2)
    with pytest.raises(RuntimeError, match="sync_weights"):  # the step's weights are not in the engine yet
        engine.generate(model, prompts, GREEDY)
    after, h1 = both(engine, hf, model, prompts)
    assert after.completion_ids == h1.completion_ids  # the engine generates from the updated weights
    assert after.completion_ids != before.completion_ids  # ... which changed the completions
    if lora:  # the training weights were not merged into: the frozen base is bit-identical
        start = dict(base.named_parameters())
        frozen = [(n.replace(".base_layer", ""), p) for n, p in model.get_base_model().named_parameters()
                  if "lora_" not in n]
        assert len(frozen) == len(start) and all(torch.equal(p, start[n]) for n, p in frozen)


def test_sampling_groups_and_logps(setup: tuple[Any, Any, list[list[int]]], engine: VLLMEngine) -> None:
    from alignkit.models.policy import CausalLMLogps, forward_logps
    from alignkit.rollout.experience import collate_samples, flat

    tok, model, prompts = setup
    rows = [p for p in prompts[:4] for _ in range(8)]  # 4 groups of 8, as a GRPO rollout sends them
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=1.0)
    torch.manual_seed(0)
    gens = generate_once(engine, model, rows, params)
    assert len(gens.completion_ids) == 32 and gens.logps is not None
    assert all(len(lp) == len(c) for lp, c in zip(gens.logps, gens.completion_ids))
    assert len({tuple(c) for c in gens.completion_ids[:8]}) > 1  # a group's samples differ
    torch.manual_seed(0)
    assert engine.generate(model, rows, params).completion_ids == gens.completion_ids  # seeded by torch's generator
    samples = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(rows, gens.completion_ids)]
    batch = collate_samples(samples, tok.pad_token_id)
    trainer = forward_logps(CausalLMLogps(model), batch, temperature=0.7).detach()
    sampler = torch.tensor([x for lp in gens.logps for x in lp])
    assert trainer.shape == sampler.shape
    assert (trainer - sampler).abs().max() < 1e-3  # the same distribution: importance ratios ~1
    assert flat(batch, "targets").numel() == sampler.numel()


def test_grpo_with_vllm_learns_the_digit_task(policy: Path, engine: VLLMEngine, tmp_path: Path) -> None:
    """configs/grpo.yaml with engine vllm, in this process (it reuses the engine of the tests above)."""
    import alignkit.algorithms  # noqa: F401
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    out = tmp_path / "grpo"
    run_train(load_config(str(CONFIGS / "grpo.yaml"), [f"model.name_or_path={policy}", f"output_dir={out}",
                                                        "training.max_steps=60", "data.eval=[]", "logging.plot=false",
                                                        "rollout.engine=vllm"]))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    reward = [r["reward_mean"] for r in logged if "reward_mean" in r]
    assert len(reward) == 6
    rise = (reward[-1] + reward[-2]) / 2 - reward[0]
    assert rise >= MIN_RISE, reward
    ratio = [r["sampler_is_ratio"] for r in logged if "sampler_is_ratio" in r]
    assert ratio and all(math.isfinite(x) and abs(x - 1) < 0.05 for x in ratio), ratio  # the correction is logged


@pytest.mark.distributed
def test_grpo_with_vllm_learns_under_two_process_ddp(policy: Path, tmp_path: Path) -> None:
    """The same run under torchrun on 2 gloo ranks (32 completions each): every rank builds its own engine, its
    seeds drawn from its own generator (the loop seeds torch per rank)."""
    out = tmp_path / "grpo_ddp"
    assert_ok(run_cli(["train", str(CONFIGS / "grpo.yaml"), f"model.name_or_path={policy}", f"output_dir={out}",
                       "training.max_steps=60", "training.per_device_batch_size=32", "data.eval=[]",
                       "logging.plot=false", "rollout.engine=vllm"], nproc=2, timeout=600))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    reward = [r["reward_mean"] for r in logged if "reward_mean" in r]
    assert len(reward) == 6
    assert (reward[-1] + reward[-2]) / 2 - reward[0] >= MIN_RISE, reward


def test_alignkit_generate_with_engine_vllm(policy: Path, tmp_path: Path) -> None:
    """``alignkit generate --engine vllm`` (its own process, its own engine) writes HF's greedy completions."""
    from alignkit.resources import resource_path

    outs = {}
    for engine in ("hf", "vllm"):
        outs[engine] = tmp_path / f"{engine}.jsonl"
        assert_ok(run_cli(["generate", str(policy), str(resource_path("digits_prompts_eval.jsonl")), "--engine", engine,
                           "--max-new-tokens", "8", "--out", str(outs[engine])], timeout=300))
    hf, vllm = ([json.loads(x)["completion"] for x in outs[e].read_text().splitlines()] for e in ("hf", "vllm"))
    assert len(hf) == len(vllm) > 10 and vllm == hf


def test_grpo_against_a_vllm_server_learns(policy: Path, tmp_path: Path) -> None:
    """Server mode: ``alignkit vllm-serve`` in its own process on a loopback port; a GRPO run with
    ``vllm.server_url`` pushes its weights there after every step and learns like the colocated run."""
    import subprocess
    import sys
    import time

    from alignkit.rollout.vllm_server import Client
    from tests.conftest import child_env, free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "alignkit", "vllm-serve", str(policy), "--port", str(port),
                               "--max-model-len", str(MAX_LEN)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=child_env())
    try:
        client, deadline = Client(f"http://127.0.0.1:{port}"), time.monotonic() + 240
        while not client.health():
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read() if server.poll() else "timeout"
            time.sleep(1)
        out = tmp_path / "grpo_server"
        assert_ok(run_cli(["train", str(CONFIGS / "grpo.yaml"), f"model.name_or_path={policy}", f"output_dir={out}",
                           "training.max_steps=60", "data.eval=[]", "logging.plot=false", "rollout.engine=vllm",
                           f"vllm.server_url=http://127.0.0.1:{port}"], timeout=600))
    finally:
        server.terminate()
        server.wait(timeout=60)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    reward = [r["reward_mean"] for r in logged if "reward_mean" in r]
    assert len(reward) == 6 and (reward[-1] + reward[-2]) / 2 - reward[0] >= MIN_RISE, reward


@pytest.mark.distributed
def test_fsdp2_pushes_the_gathered_weights(policy: Path, tmp_path: Path) -> None:
    """FSDP2 on 2 ranks: each rollout's engine gets the weights gathered once by ``Strategy.full_params``. The
    logged sampler / trainer probability ratio is ~1 at every step only if the engine holds the updated weights
    (a stale or sharded copy puts it far from 1 after the first step)."""
    out = tmp_path / "grpo_fsdp"
    assert_ok(run_cli(["train", str(CONFIGS / "grpo.yaml"), f"model.name_or_path={policy}", f"output_dir={out}",
                       "training.max_steps=4", "training.per_device_batch_size=32", "data.eval=[]",
                       "logging.plot=false", "logging.logging_steps=1", "rollout.engine=vllm",
                       "distributed.strategy=fsdp", "training.learning_rate=3e-3"], nproc=2, timeout=600))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    ratio = [r["sampler_is_ratio"] for r in logged if "sampler_is_ratio" in r]
    assert len(ratio) == 4 and all(abs(x - 1) < 1e-3 for x in ratio), ratio


def test_a_head_size_the_cpu_kernels_refuse_is_one_line(tmp_path: Path) -> None:
    """The micro model (head_dim 16): one error line naming the sizes vLLM's CPU attention supports, before any
    engine is built, from the colocated engine and from the server alike."""
    from alignkit.resources import resource_path

    micro = build_tiny_model(tmp_path / "micro", size="micro", seed=0)
    for cmd in (["generate", str(micro), str(resource_path("digits_prompts_eval.jsonl")), "--engine", "vllm"],
                ["vllm-serve", str(micro), "--port", "1"]):
        proc = run_cli(cmd, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [x for x in proc.stderr.splitlines() if x.startswith("alignkit: error:")]
        assert len(lines) == 1 and "this model has 16" in lines[0] and "micro64" in lines[0], proc.stderr[-3000:]
