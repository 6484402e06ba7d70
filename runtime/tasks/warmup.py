"""The built-in `tiny-arith` policy and its supervised warm-up on the arith-chain task.

`tiny-arith` is a ~0.6M-parameter Llama-architecture causal LM over the character tokenizer.
The project warms it up itself by supervised training on arith-chain solutions, and stops as
soon as greedy decoding reproduces the reference solution of `target_greedy_accuracy` of the
held-out problems (checked teacher-forced: every argmax equals the reference token, one forward
pass). Such a policy knows the task, but sampled at temperature 1 its leftover uncertainty makes
digit errors that compound along the chain, so it gets a mid reward: right often enough to learn
from, wrong often enough (mostly on long chains) to leave RL room to improve it. A
stop criterion on the sampled reward itself would be fooled by a policy that only guesses the
final remainder (right about 1 in d times).

The result is cached under `${RLJOB_CACHE:-~/.cache/rljob}/models/tiny-arith-<hash>/`; the hash
covers the whole recipe, so changing any knob trains a new model instead of reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rljob.runtime.tasks.synthetic import ArithChainTask, Problem
from rljob.runtime.tasks.tokenizer import CharTokenizer, TaskTokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

BUILTIN_NAME = "tiny-arith"
WARMUP_REPORT = "warmup.json"
RECIPE_FORMAT = 2  # bump when the training code changes in a way the recipe fields do not capture


@dataclass(frozen=True)
class TinyArithRecipe:
    """Architecture and supervised warm-up of the built-in policy; all of it goes into the cache key."""

    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 320
    task_seed: int = 10_007  # warm-up problems; job datasets use other seeds by default
    min_divisor: int = 2
    max_divisor: int = 9
    max_steps_per_problem: int = 30
    batch_size: int = 64
    max_train_steps: int = 1200
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    eval_every: int = 25
    eval_problems: int = 128
    target_greedy_accuracy: float = 0.5
    seed: int = 0

    def task(self, seed: int | None = None) -> ArithChainTask:
        return ArithChainTask(
            seed=self.task_seed if seed is None else seed,
            max_steps=self.max_steps_per_problem,
            min_divisor=self.min_divisor,
            max_divisor=self.max_divisor,
        )

    def fingerprint(self, tokenizer: CharTokenizer) -> str:
        payload = {"recipe": asdict(self), "alphabet": tokenizer.alphabet, "format": RECIPE_FORMAT}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


DEFAULT_RECIPE = TinyArithRecipe()


def cache_root() -> Path:
    """`$RLJOB_CACHE`, else ~/.cache/rljob."""
    return Path(os.environ.get("RLJOB_CACHE") or Path.home() / ".cache" / "rljob")


def builtin_policy_dir(recipe: TinyArithRecipe = DEFAULT_RECIPE) -> Path:
    """Cache directory of the built-in policy trained with recipe."""
    return cache_root() / "models" / f"{BUILTIN_NAME}-{recipe.fingerprint(CharTokenizer())}"


def _new_model(recipe: TinyArithRecipe, tokenizer: CharTokenizer) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def supervised_batch(problems: list[Problem], tokenizer: TaskTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+solution+EOS ids and labels (-100 outside the response)."""
    pairs = [(tokenizer.encode_prompt(p.prompt), [*tokenizer.encode(p.solution), tokenizer.eos_token_id]) for p in problems]
    width = max(len(a) + len(b) for a, b in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(pairs):
        ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        labels[row, len(prompt) : len(prompt) + len(response)] = torch.tensor(response)
    return ids, labels


@dataclass(frozen=True)
class SolutionScores:
    """How well a model reproduces reference solutions, from one teacher-forced forward pass."""

    greedy_accuracy: float  # share of problems whose every reference token is the argmax
    exact_solution_probability: float  # mean probability that sampling at temperature 1 reproduces one


@torch.no_grad()
def solution_scores(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> SolutionScores:
    """Greedy accuracy and exact-solution probability of batch (ids, labels) from supervised_batch.

    The probability is a lower bound of the expected sampled reward (a wrong chain can still end
    on the right answer).
    """
    logits = model(input_ids=ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    scored = targets != -100
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    greedy = ((logits.argmax(-1) == targets) | ~scored).all(-1)
    return SolutionScores(
        greedy_accuracy=float(greedy.float().mean()),
        exact_solution_probability=float((logp * scored).sum(-1).exp().mean()),
    )


@torch.no_grad()
def sampled_reward(
    model: PreTrainedModel,
    tokenizer: TaskTokenizer,
    problems: list[Problem],
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
) -> float:
    """Mean math-answer reward of one sampled response per problem (Hugging Face generate, left-padded)."""
    from rljob.runtime.tasks.reward import math_answer_reward

    prompts = [tokenizer.encode_prompt(p.prompt) for p in problems]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(  # type: ignore[operator]  # nn.Module's __getattr__ types attributes as Tensor | Module
            input_ids=ids.to(model.device),
            attention_mask=attention.to(model.device),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = [tokenizer.decode(row[width:].tolist()) for row in out]
    return sum(math_answer_reward(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


def _length_bucketed_batches(recipe: TinyArithRecipe, task: ArithChainTask, rng: random.Random):  # noqa: ANN202
    """Endless batches of similar-length problems: the long tail would otherwise make most of each batch padding."""
    start = 0
    pool = recipe.batch_size * 8
    while True:
        problems = sorted(task.problems(pool, start=start), key=lambda p: len(p.solution))
        start += pool
        batches = [problems[i : i + recipe.batch_size] for i in range(0, pool, recipe.batch_size)]
        rng.shuffle(batches)
        yield from batches


def warm_up(recipe: TinyArithRecipe = DEFAULT_RECIPE, progress: bool = True) -> tuple[PreTrainedModel, CharTokenizer, dict]:
    """Train the built-in policy from scratch; returns model, tokenizer and a report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tokenizer = CharTokenizer()
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = _new_model(recipe, tokenizer)
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay, betas=(0.9, 0.98)
        )
        eval_ids, eval_labels = supervised_batch(recipe.task(seed=recipe.task_seed + 1).problems(recipe.eval_problems), tokenizer)
        batches = _length_bucketed_batches(recipe, recipe.task(), random.Random(recipe.seed))
        scores = SolutionScores(0.0, 0.0)
        steps = 0
        columns = (
            TextColumn("[bold]warming up tiny-arith[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  greedy accuracy {task.fields[score]:.2f} → {task.fields[target]:.2f}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, disable=not progress) as bar:
            task_id = bar.add_task(
                "warm-up", total=recipe.max_train_steps, loss=0.0, score=0.0, target=recipe.target_greedy_accuracy
            )
            for steps in range(1, recipe.max_train_steps + 1):
                warm = min(1.0, steps / recipe.warmup_steps)
                cosine = 0.5 * (1 + math.cos(math.pi * (steps - 1) / recipe.max_train_steps))
                for group in optimizer.param_groups:
                    group["lr"] = recipe.learning_rate * warm * cosine
                ids, labels = supervised_batch(next(batches), tokenizer)
                loss = model(input_ids=ids, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                bar.update(task_id, advance=1, loss=loss.item())
                if steps % recipe.eval_every == 0:
                    model.eval()
                    scores = solution_scores(model, eval_ids, eval_labels)
                    model.train()
                    bar.update(task_id, score=scores.greedy_accuracy)
                    log.debug("warm-up step %d: loss %.3f, %s", steps, loss.item(), scores)
                    if scores.greedy_accuracy >= recipe.target_greedy_accuracy:
                        break
    model.eval()
    check = recipe.task(seed=recipe.task_seed + 2).problems(64)
    report = {
        "recipe": asdict(recipe),
        "train_steps": steps,
        **asdict(scores),
        "sampled_reward_t1": sampled_reward(model, tokenizer, check, seed=recipe.seed),
        "seconds": round(time.perf_counter() - started, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if scores.greedy_accuracy < recipe.target_greedy_accuracy:
        log.warning(
            "tiny-arith warm-up stopped at %d steps below its target greedy accuracy (%.2f < %.2f)",
            steps, scores.greedy_accuracy, recipe.target_greedy_accuracy,
        )
    return model, tokenizer, report


def _save(directory: Path, model: PreTrainedModel, tokenizer: TaskTokenizer, report: dict) -> None:
    """Write into a temporary sibling, then rename: a concurrent or interrupted build never leaves half a cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save(staging)
        (staging / WARMUP_REPORT).write_text(json.dumps(report, indent=2))
        os.replace(staging, directory)
    except OSError:
        if not (directory / WARMUP_REPORT).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def builtin_policy(
    recipe: TinyArithRecipe = DEFAULT_RECIPE, progress: bool = True, device: str = "cpu"
) -> tuple[PreTrainedModel, TaskTokenizer]:
    """The built-in policy: loaded from the cache, or warmed up and cached on first use."""
    from rljob.runtime.models.loading import load_causal_lm

    directory = ensure_builtin_arith(recipe, progress)
    return load_causal_lm(directory, field="spec.model.path", dtype=torch.float32, device=device), load_tokenizer(directory)


def ensure_builtin_arith(recipe: TinyArithRecipe = DEFAULT_RECIPE, progress: bool = True) -> Path:
    """The cached tiny-arith folder, warmed up and written on first use."""
    directory = builtin_policy_dir(recipe)
    if not (directory / WARMUP_REPORT).exists():
        log.info("no cached tiny-arith policy at %s: warming one up (once, about 1-3 minutes on 2 cores)", directory)
        model, tokenizer, report = warm_up(recipe, progress=progress)
        _save(directory, model, tokenizer, report)
        log.info("tiny-arith warm-up: %s", {k: v for k, v in report.items() if k != "recipe"})
    return directory
