"""Train the demo pair in examples/models/: a Gated-DeltaNet hybrid target and a small
dense draft distilled to agree with it, sharing one byte-level BPE tokenizer.

    python examples/train_demo.py [--out examples/models] [--threads 1] [--stage all|draft|mtp]

A build tool, not part of the library: it uses torch (CPU), transformers
(Qwen3NextForCausalLM, Qwen3ForCausalLM) and tokenizers, none of which mlx_lm needs at
run time. Measured here with torch 2.13.0, transformers 5.24.0, tokenizers 0.23.3 on
one core of a shared Xeon (bf16 autocast on AMX): about 50 minutes (22 target, 27 draft).
The draft was retrained later on an AMD EPYC without bf16 instructions, in float32
(`--precision auto` picks it there): 29 minutes for `--stage draft`.


Stages (each seeded, so a rerun with the same versions gives the same files):
1. Corpus: the `.py` sources of the running interpreter's standard library (Python
   Software Foundation License, permissive), as a fixed sorted file list; tests,
   encoding tables, generated data and files over 256 KB are left out. Every 50th file
   is held out for validation. Python 3.11.7 was used for the committed checkpoints;
   another version gives a slightly different corpus, hence slightly different weights.
2. Tokenizer: byte-level BPE (GPT-2 pre-tokenizer regex), 4096 tokens, special tokens
   `<|endoftext|>` (end of each file and eos), `<|im_start|>`, `<|im_end|>`. These are
   base (completion) models: the chat template passes the message contents through as
   plain text, so `mlx_lm.generate --prompt "def fibonacci(n):"` completes the code.
3. Target: qwen3_next, 8 layers ([GDN, GDN, GDN, attention] x 2), hidden 256, dense MLP
   (num_experts 0: on a CPU a dense hybrid verifies k+1 tokens far more cheaply than a
   mixture of experts), tied embeddings, trained from scratch on next-token prediction.
4. Draft: qwen3, 2 layers, hidden 128, tied embeddings, distilled on the target's full
   next-token law (soft targets, KL(target || draft)), not on its argmax: on text the
   target writes itself, greedily and by sampling at T = 0.7 and T = 1.0 (what a greedy
   or a sampling speculative run asks the draft to guess), from two kinds of corpus
   prompts (random windows, and short windows that begin a line, as a user's prompt
   does), and on corpus windows. The target's laws are computed once, kept as its top
   64 tokens plus the rest as one outcome.
5. MTP head (`--stage mtp` retrains only it): the target's multi-token-prediction head
   (`mtp.*`, one full-attention layer, as the Qwen3-Next checkpoints carry), the target
   frozen: from its post-norm hidden state h_t and the teacher-forced token x_{t+1} it
   learns the target's own law of x_{t+2} (KL on corpus windows); added to the target's
   safetensors (float16) with `num_nextn_predict_layers: 1` in its config.
Both are saved as transformers writes them (config.json, model.safetensors in float16,
generation_config.json) plus tokenizer.json / tokenizer_config.json, so transformers,
this library and upstream mlx-lm load the same files. The qwen3_next config also carries
the transformers-4 keys (`rope_theta`, `partial_rotary_factor`,
`full_attention_interval`) next to `rope_parameters`, since upstream mlx-lm 0.32 reads
only those. A summary (sizes, losses, timings, corpus hash) goes to
`<out>/training_log.json`.

torch runs on `--threads` threads (default 1) so the machine's other core stays free.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from typing import Tuple
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: one thread, deterministic merges
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET_NAME = "qwen3-next-stdlib"
DRAFT_NAME = "qwen3-draft-stdlib"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096
EXCLUDED_DIRS = {"test", "tests", "site-packages", "__pycache__", "pydoc_data", "encodings", "idle_test"}
MAX_FILE_BYTES = 256 * 1024
# The draft learns from text the target writes at these temperatures (0: greedy), in
# turn: what speculative decoding asks it to guess, greedy or sampling.
CONTINUATION_TEMPS = (0.0, 0.7, 1.0)
# Base models: render the conversation as its plain text (no role markers), so a chat
# front end still gets a code completion.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)

TARGET_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=0, tie_word_embeddings=True, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0, pad_token_id=0,
)
DRAFT_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0, pad_token_id=0,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- 1. corpus -----------------------------------------------------------------------


def corpus_files(root: Path):
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(path)
    return files


def read_corpus():
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files(root)]
    train = [t for i, t in enumerate(texts) if i % 50 != 49]
    val = [t for i, t in enumerate(texts) if i % 50 == 49]
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    info = dict(root=str(root), python=platform.python_version(), files=len(texts),
                bytes=sum(len(t.encode()) for t in texts), sha256=digest, licence="PSF-2.0")
    return train, val, info


# --- 2. tokenizer --------------------------------------------------------------------


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=4096,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def encode_stream(tok, texts) -> np.ndarray:
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for encoding in tok.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


class Batches:
    """Random windows of `length` + 1 tokens from a token stream, seeded."""

    def __init__(self, stream: np.ndarray, seed: int):
        self.stream = torch.from_numpy(stream)
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, batch: int, length: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - length - 1, (batch,), generator=self.gen)
        return torch.stack([self.stream[s : s + length + 1] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# bf16 autocast is fast only where the CPU has bf16 matrix instructions (the Xeon with
# AMX of the first builds); elsewhere torch emulates it, ~8x slower than float32 (AMD
# EPYC without avx512_bf16: measured). main() sets it once from --precision.
BF16 = {"enabled": True}


def cpu_has_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16["enabled"])


@torch.no_grad()
def eval_loss(model, stream: np.ndarray, length: int = 256, windows: int = 32) -> float:
    model.eval()
    starts = np.linspace(0, len(stream) - length - 2, windows).astype(int)
    batch = torch.stack([torch.from_numpy(stream[s : s + length + 1]) for s in starts])
    losses = []
    for chunk in batch.split(8):
        with autocast():
            logits = model(input_ids=chunk[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1)))
    model.train()
    return float(torch.stack(losses).mean())


# --- 3. target -----------------------------------------------------------------------


def train_target(train_ids, val_ids, args):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(args.seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**TARGET_CONFIG))
    params = sum(p.numel() for p in model.parameters())
    log(f"target: {params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches = Batches(train_ids, args.seed + 1)
    model.train()
    start, history = time.time(), []
    for step in range(args.target_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.target_steps, args.target_lr, args.warmup)
        batch = batches(args.batch, args.seq_len)
        with autocast():
            logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(loss.item())
        if step % 25 == 0 or step == args.target_steps - 1:
            rate = (step + 1) * args.batch * args.seq_len / (time.time() - start)
            log(f"target step {step}/{args.target_steps} loss {np.mean(history[-25:]):.3f} ({rate:.0f} tok/s)")
    seconds = time.time() - start
    val = eval_loss(model, val_ids)
    log(f"target done in {seconds / 60:.1f} min, train loss {np.mean(history[-50:]):.3f}, val loss {val:.3f}")
    info = dict(parameters=params, steps=args.target_steps, batch=args.batch, seq_len=args.seq_len,
                tokens_seen=args.target_steps * args.batch * args.seq_len, minutes=seconds / 60,
                train_loss=float(np.mean(history[-50:])), val_loss=val, peak_lr=args.target_lr)
    return model, info


# --- 4. draft ------------------------------------------------------------------------


def line_starts(tok, stream: np.ndarray) -> np.ndarray:
    """Positions of `stream` that begin a line: after a token ending in a newline, or
    after an end-of-file token."""
    ends_line = np.array([tok.decode([i]).endswith("\n") for i in range(tok.get_vocab_size())])
    ends_line[tok.token_to_id("<|endoftext|>")] = True
    return np.nonzero(ends_line[stream[:-1]])[0] + 1


@torch.no_grad()
def target_continuations(target, tok, train_ids, args) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Text the target writes itself: sequences (N, gen_prompt + gen_new), each one's
    prompt length (N,) and the temperature it was continued at (N,; 0 is greedy).
    Batches cycle through greedy, T = 0.7 and T = 1.0 (full law: no top-k, no top-p),
    and alternate two prompt kinds: random windows of gen_prompt tokens, and short
    windows (4 to gen_prompt tokens) that begin a line, as a user's prompt does,
    continued to the same total length."""
    target.eval()
    batches = Batches(train_ids, args.seed + 3)
    starts = torch.from_numpy(line_starts(tok, train_ids))
    gen = torch.Generator().manual_seed(args.seed + 6)
    torch.manual_seed(args.seed + 10)  # generate() samples from the global generator
    stream = torch.from_numpy(train_ids)
    total = args.gen_prompt + args.gen_new
    sequences, prompt_lens, temps = [], [], []
    start = time.time()
    for i in range(args.continuation_batches):
        if i % 2:
            prompts = batches(args.gen_batch, args.gen_prompt - 1)
        else:
            length = int(torch.randint(4, args.gen_prompt + 1, (1,), generator=gen))
            picks = starts[torch.randint(0, len(starts) - 1, (args.gen_batch,), generator=gen)]
            prompts = torch.stack([stream[s : s + length] for s in picks.tolist()])
        temp = CONTINUATION_TEMPS[i % len(CONTINUATION_TEMPS)]
        sampling = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp else dict(do_sample=False)
        new = total - prompts.shape[1]
        out = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **sampling)
        sequences.append(out)
        prompt_lens.append(torch.full((len(out),), prompts.shape[1]))
        temps.append(torch.full((len(out),), temp))
        if i % 6 == 0:
            log(f"continuations {i + 1}/{args.continuation_batches} ({time.time() - start:.0f} s)")
    return torch.cat(sequences), torch.cat(prompt_lens), torch.cat(temps)


def continuation_mask(prompt_lens: torch.Tensor, length: int) -> torch.Tensor:
    """(N, length - 1) True where position t predicts a continuation token (t + 1 >= prompt)."""
    return torch.arange(1, length)[None] >= prompt_lens[:, None]


@torch.no_grad()
def teacher_top_k(target, sequences: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token law at every position of `sequences` (N, L), kept as its k
    most likely tokens: log-probabilities (N, L - 1, k) float16 and ids (N, L - 1, k)
    int16. One target forward per chunk here, so distillation steps need none (the
    full laws of 4096 tokens would not fit in memory)."""
    log_probs, ids = [], []
    for chunk in sequences.split(32):
        with autocast():
            logits = target(input_ids=chunk[:, :-1]).logits.float()
        top = F.log_softmax(logits, -1).topk(k, dim=-1)
        log_probs.append(top.values.to(torch.float16))
        ids.append(top.indices.to(torch.int16))
    return torch.cat(log_probs), torch.cat(ids)


def top_k_kl(student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) over the partition {each of the target's top k tokens, all the
    rest as one outcome}: student_logits (B, T, V), teacher (B, T, k) -> a scalar, mean per
    position. It lower-bounds the full KL and still pulls the draft's tail mass to the
    target's, which speculative sampling at T = 1 needs (there the tail is accepted too)."""
    log_q = F.log_softmax(student_logits, -1)
    log_q_top = log_q.gather(-1, teacher_ids.long())  # (B, T, k)
    log_p_top = teacher_log_probs.float()
    p_top = log_p_top.exp()
    p_rest = (1 - p_top.sum(-1)).clamp(min=0)  # (B, T)
    # log(1 - sum q_top), kept finite where the draft puts (almost) all its mass on the top k
    log_q_rest = torch.log1p(-log_q_top.exp().sum(-1).clamp(max=1 - 1e-6))
    log_p_rest = torch.log(p_rest.clamp(min=1e-12))
    kl = (p_top * (log_p_top - log_q_top)).sum(-1) + p_rest * (log_p_rest - log_q_rest)
    return kl.mean()


def soft_step(draft, opt, sequences, teacher_log_probs, teacher_ids) -> float:
    """One step of top_k_kl on every position (prompt and continuation) of `sequences`."""
    with autocast():
        logits = draft(input_ids=sequences[:, :-1]).logits.float()
    return optimizer_step(draft, opt, top_k_kl(logits, teacher_log_probs, teacher_ids))


def optimizer_step(draft, opt, loss) -> float:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def held_out_agreement(draft, target, sequences: torch.Tensor, prompt_lens: torch.Tensor,
                       temps: torch.Tensor) -> dict:
    """On the continuation positions of held-out sequences: the fraction where the draft's
    argmax is the target's (greedy ones), and mean sum_x min(p_T, q_T) on the ones
    sampled at T, both laws scaled by that T (what speculative sampling accepts)."""
    draft.eval()
    sums, counts = {}, {}
    for chunk, lens, chunk_temps in zip(sequences.split(16), prompt_lens.split(16), temps.split(16)):
        with autocast():
            d = draft(input_ids=chunk).logits.float()[:, :-1]
            t = target(input_ids=chunk).logits.float()[:, :-1]
        mask = continuation_mask(lens, chunk.shape[1])
        for temp in chunk_temps.unique().tolist():
            rows = mask & (chunk_temps == temp)[:, None]
            if temp == 0:
                name, values = "greedy_agreement", (d.argmax(-1) == t.argmax(-1)).float()
            else:
                name = f"min_pq_T{temp:g}"
                values = torch.minimum(F.softmax(d / temp, -1), F.softmax(t / temp, -1)).sum(-1)
            sums[name] = sums.get(name, 0.0) + float(values[rows].sum())
            counts[name] = counts.get(name, 0) + int(rows.sum())
    draft.train()
    return {name: sums[name] / counts[name] for name in sorted(sums)}


def train_draft(target, tok, train_ids, args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    torch.manual_seed(args.seed + 2)
    draft = Qwen3ForCausalLM(Qwen3Config(**DRAFT_CONFIG))
    params = sum(p.numel() for p in draft.parameters())
    log(f"draft: {params / 1e6:.2f}M parameters")
    start = time.time()
    sequences, prompt_lens, temps = target_continuations(target, tok, train_ids, args)
    # Held out: the first batch of each (prompt kind, temperature).
    held = torch.zeros(len(sequences), dtype=torch.bool)
    held[: 2 * len(CONTINUATION_TEMPS) * args.gen_batch] = True
    held_out = sequences[held], prompt_lens[held], temps[held]
    sequences, prompt_lens = sequences[~held], prompt_lens[~held]
    num_new = int(continuation_mask(prompt_lens, sequences.shape[1]).sum())
    # Corpus text too: windows as long as the continuations, with the target's laws.
    corpus = Batches(train_ids, args.seed + 4)(args.corpus_windows, sequences.shape[1] - 1)
    sequences = torch.cat([sequences, corpus])
    log(f"{num_new} continuation tokens and {corpus.numel()} corpus tokens in {(time.time() - start) / 60:.1f} min")
    teacher_log_probs, teacher_ids = teacher_top_k(target, sequences, args.teacher_top_k)
    log(f"teacher laws (top {args.teacher_top_k}) in {(time.time() - start) / 60:.1f} min")

    steps = args.draft_steps
    opt = torch.optim.AdamW(draft.parameters(), lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 5)
    draft.train()
    history = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.draft_lr, args.warmup)
        rows = torch.randint(0, len(sequences), (2 * args.batch,), generator=gen)
        history.append(soft_step(draft, opt, sequences[rows], teacher_log_probs[rows], teacher_ids[rows]))
        if step % 25 == 0 or step == steps - 1:
            log(f"draft step {step}/{steps} top-{args.teacher_top_k} KL {np.mean(history[-25:]):.3f}")
    seconds = time.time() - start
    agreement = held_out_agreement(draft, target, *held_out)
    log(f"draft done in {seconds / 60:.1f} min; on held-out continuations {agreement}")
    info = dict(parameters=params, steps=steps, loss="KL(target || draft), target top-k plus the rest",
                teacher_top_k=args.teacher_top_k, continuation_temperatures=list(CONTINUATION_TEMPS),
                continuation_tokens=num_new, corpus_tokens=corpus.numel(), minutes=seconds / 60,
                train_kl=float(np.mean(history[-50:])), heldout=agreement)
    return draft, info


# --- 5. MTP head -------------------------------------------------------------------


class MTPHead(torch.nn.Module):
    """The multi-token-prediction head in the checkpoint layout (`mtp.*`): for position
    t, fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]), one
    full-attention decoder layer like the target's (rope at position t), `norm`, then
    the target's tied lm_head; it predicts x_{t+2}. h_t is the target's final hidden
    state after its final norm. The norms are the family's zero-centred ones."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_next import modeling_qwen3_next as qn

        hidden, eps = config.hidden_size, config.rms_norm_eps
        attention_layer = config.layer_types.index("full_attention")
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = qn.Qwen3NextRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = qn.Qwen3NextRMSNorm(hidden, eps)
        self.layers = torch.nn.ModuleList([qn.Qwen3NextDecoderLayer(config, attention_layer)])
        self.norm = qn.Qwen3NextRMSNorm(hidden, eps)
        self.rotary = qn.Qwen3NextRotaryEmbedding(config)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embedded (B, T, H) = embed(x_{t+1}), hidden (B, T, H) = h_t -> (B, T, H) after `norm`."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        x = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=None)
        return self.norm(x)


def mtp_step(head, target, opt, batch) -> Tuple[float, float]:
    """KL(target || head) for x_{t+2} on every position of `batch` (B, T): the target's
    own law after x_{t+1} (its logits at t+1) is the teacher, the head sees h_t and the
    teacher-forced x_{t+1}. Returns (loss, argmax agreement)."""
    with torch.no_grad(), autocast():
        hidden = target.model(input_ids=batch).last_hidden_state.float()  # post-norm
        teacher = target.lm_head(hidden).float()[:, 1:]  # (B, T-1, V): laws of x_{t+2}
        embedded = target.model.embed_tokens(batch[:, 1:]).float()
    with autocast():
        student = target.lm_head(head(embedded, hidden[:, :-1])).float()
    loss = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True, reduction="batchmean")
    agreement = float((student.argmax(-1) == teacher.argmax(-1)).float().mean())
    return optimizer_step(head, opt, loss / student.shape[1]), agreement


def train_mtp(target, train_ids, val_ids, args):
    """Train the head on corpus windows with the backbone frozen."""
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    config = target.config
    config._attn_implementation = "sdpa"  # causal without a mask (eager would need one)
    torch.manual_seed(args.seed + 7)
    head = MTPHead(config)
    params = sum(p.numel() for p in head.parameters())
    log(f"mtp head: {params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(head.parameters(), lr=args.mtp_lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = Batches(train_ids, args.seed + 8)
    start, history, agreements = time.time(), [], []
    for step in range(args.mtp_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.mtp_steps, args.mtp_lr, args.warmup)
        loss, agreement = mtp_step(head, target, opt, batches(args.batch, args.seq_len))
        history.append(loss)
        agreements.append(agreement)
        if step % 25 == 0 or step == args.mtp_steps - 1:
            log(f"mtp step {step}/{args.mtp_steps} KL {np.mean(history[-25:]):.3f} "
                f"argmax agreement {np.mean(agreements[-25:]):.3f}")
    seconds = time.time() - start
    head.eval()
    with torch.no_grad():
        val_batch = Batches(val_ids, args.seed + 9)(8, args.seq_len)
        _, val_agreement = mtp_eval(head, target, val_batch)
    log(f"mtp done in {seconds / 60:.1f} min; held-out argmax agreement with the target {val_agreement:.3f}")
    info = dict(parameters=params, steps=args.mtp_steps, minutes=seconds / 60, peak_lr=args.mtp_lr,
                train_kl=float(np.mean(history[-50:])), train_agreement=float(np.mean(agreements[-50:])),
                heldout_agreement=val_agreement)
    return head, info


@torch.no_grad()
def mtp_eval(head, target, batch) -> Tuple[float, float]:
    with autocast():
        hidden = target.model(input_ids=batch).last_hidden_state.float()
        teacher = target.lm_head(hidden).float()[:, 1:]
        student = target.lm_head(head(target.model.embed_tokens(batch[:, 1:]).float(), hidden[:, :-1])).float()
    return 0.0, float((student.argmax(-1) == teacher.argmax(-1)).float().mean())


def save_mtp(head, directory: Path) -> int:
    """Add the head to the target's checkpoint as `mtp.*` (float16, the layout of the
    Qwen3-Next checkpoints), leaving every other tensor as it was, and declare it in
    config.json (`num_nextn_predict_layers`)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    for name, value in head.state_dict().items():
        if not name.startswith("rotary."):
            tensors["mtp." + name] = value.to(torch.float16).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sum(f.stat().st_size for f in directory.iterdir())


# --- saving --------------------------------------------------------------------------


def save(model, tokenizer, directory: Path, extra_config=None) -> int:
    model = model.to(torch.float16)
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    # A tokenizer_config that transformers 4 reads as well as 5 (5 writes its own
    # "TokenizersBackend" class and a separate chat_template.jinja).
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=SPECIAL_TOKENS[1:], model_max_length=4096,
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
    ), indent=2) + "\n")
    if extra_config:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        config.update(extra_config)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sum(f.stat().st_size for f in directory.iterdir())


def load_target(directory: Path):
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM.from_pretrained(directory, dtype=torch.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "models")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", choices=["all", "draft", "mtp"], default="all",
                        help="'draft': keep the saved tokenizer and target, retrain the draft; "
                        "'mtp': keep them and the draft, retrain only the target's MTP head")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--target-steps", type=int, default=550)
    parser.add_argument("--target-lr", type=float, default=2e-3)
    parser.add_argument("--draft-lr", type=float, default=3e-3)
    parser.add_argument("--draft-steps", type=int, default=1400)
    parser.add_argument("--continuation-batches", type=int, default=48,
                        help="batches of target continuations (a multiple of 6: prompt kinds x temperatures)")
    parser.add_argument("--corpus-windows", type=int, default=512,
                        help="corpus windows the draft also learns the target's laws on")
    parser.add_argument("--teacher-top-k", type=int, default=64)
    parser.add_argument("--precision", choices=["auto", "bf16", "float32"], default="auto",
                        help="autocast to bf16 or not; auto: bf16 where the CPU has bf16 instructions")
    parser.add_argument("--gen-batch", type=int, default=32)
    parser.add_argument("--gen-prompt", type=int, default=32)
    parser.add_argument("--gen-new", type=int, default=96)
    parser.add_argument("--mtp-steps", type=int, default=700)
    parser.add_argument("--mtp-lr", type=float, default=2e-3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.continuation_batches % 6:
        raise ValueError(f"--continuation-batches {args.continuation_batches} is not a multiple of 6 "
                         "(2 prompt kinds x 3 temperatures)")
    BF16["enabled"] = args.precision == "bf16" or (args.precision == "auto" and cpu_has_bf16())
    log(f"autocast to bf16: {BF16['enabled']}")
    target_dir, draft_dir = args.out / TARGET_NAME, args.out / DRAFT_NAME
    log_path = args.out / "training_log.json"
    started = time.time()

    train_texts, val_texts, corpus = read_corpus()
    log(f"corpus: {corpus['files']} files, {corpus['bytes'] / 1e6:.1f} MB from {corpus['root']}")
    if args.stage == "all":
        tok = train_tokenizer(train_texts)
        summary = dict(corpus=corpus, versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                                                    transformers=__import__("transformers").__version__,
                                                    tokenizers=__import__("tokenizers").__version__))
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        summary = json.loads(log_path.read_text())
        if args.stage == "draft":
            summary.pop("total_minutes", None)  # of the run that made the old draft
    summary["mtp_args" if args.stage == "mtp" else "args"] = {k: str(v) for k, v in vars(args).items()}
    tokenizer = wrap_tokenizer(tok)
    train_ids, val_ids = encode_stream(tok, train_texts), encode_stream(tok, val_texts)
    log(f"tokens: {len(train_ids)} train, {len(val_ids)} validation ({corpus['bytes'] / (len(train_ids) + len(val_ids)):.2f} bytes/token)")
    summary["tokens"] = dict(train=len(train_ids), validation=len(val_ids))

    if args.stage == "all":
        target, summary["target"] = train_target(train_ids, val_ids, args)
        upstream_keys = dict(rope_theta=TARGET_CONFIG["rope_parameters"]["rope_theta"],
                             partial_rotary_factor=TARGET_CONFIG["rope_parameters"]["partial_rotary_factor"],
                             full_attention_interval=4)
        summary["target"]["bytes"] = save(target, tokenizer, target_dir, upstream_keys)
    # The draft and the head learn from the target as shipped (float16 weights, computed in float32).
    target = load_target(target_dir)
    if args.stage != "mtp":
        summary["target"]["val_loss_float16_weights"] = eval_loss(target, val_ids)
        draft, summary["draft"] = train_draft(target, tok, train_ids, args)
        summary["draft"]["bytes"] = save(draft, tokenizer, draft_dir)
        summary["draft"]["bf16_autocast"] = BF16["enabled"]
    if args.stage != "draft":
        head, summary["mtp"] = train_mtp(target, train_ids, val_ids, args)
        summary["mtp"]["target_bytes_with_head"] = save_mtp(head, target_dir)
    minutes = (time.time() - started) / 60
    summary[{"all": "total_minutes", "draft": "draft_stage_minutes", "mtp": "mtp_stage_minutes"}[args.stage]] = minutes
    log_path.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done in {minutes:.1f} min: {target_dir} ({summary['target']['bytes'] / 1e6:.1f} MB), "
        f"{draft_dir} ({summary['draft']['bytes'] / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
