"""`mlx_lm.chat`: chat with a model on the command line.

Each line read from stdin is a user turn, answered as it streams; `q` (or `exit`) or
the end of the input ends the chat, `r` starts a new one, `h` lists these commands.

The prompt cache is kept from turn to turn, and each turn feeds only its new tokens:
the conversation is rendered with the chat template, and where that text continues the
text of the tokens the cache holds (the last prompt, then the answer as generated),
those tokens are kept and only the rest of the text is encoded. Where it does not (the
model ended with an EOS token the template closes its own way, or the template rewrites
earlier turns), the whole rendering is encoded and the cache is trimmed back to the
common prefix. Either way the model sees tokens that decode to the rendering of the
conversation, and each answer is the one a fresh run on those tokens gives (with
--max-kv-size: up to what the window has dropped). An answer that starts with the text
the template puts before an answer's content (a template without a generation prompt
leaves that to the model) is recorded without it, so that the conversation renders as
the model saw it. A cache that may not trim back (recurrent layers outside
speculation, sliding windows) is also kept as it was at the end of each turn's prompt
but its last token (a copy sharing its arrays until either is written, as the server
keeps them: models/lru_prompt_cache.py); where the rendering differs, the next turn starts from
that copy and feeds the rest of the conversation again.

Under mlx.launch (more than one rank) the model is sharded over all ranks (split by
layers with --pipeline; a draft runs whole on each, drafting a pinned number of tokens:
see `distributed`); rank 0 reads each line and broadcasts it, so every rank runs the
same turns and commands on its shard of the caches, and only rank 0 prints.
"""

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import distributed
from .cache_prompt import fill_cache
from .cli_args import DEFAULT_MODEL, HelpFormatter, add_dtype_argument, positive_int, str2bool
from .drafters import PromptLookup
from .feeding import DEFAULT_PREFILL_STEP_SIZE, ids_within
from .generate import GenerationResponse, check_same_tokenizer, stream_generate
from .models.lru_prompt_cache import LRUPromptCache, copy_prompt_cache
from .models.cache import KVCache, make_prompt_cache
from .sample_utils import make_sampler
from .tokenizer_utils import TokenizerWrapper
from .utils import load, sharded_load

DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_XTC_PROBABILITY = 0.0
DEFAULT_XTC_THRESHOLD = 0.0
DEFAULT_SEED = 0
DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = 3
# DEFAULT_PREFILL_STEP_SIZE (upstream's name here too) is feeding's: one chunking everywhere.

QUIT_COMMANDS = ("q", "exit")
RESET_COMMAND = "r"
HELP_COMMAND = "h"
# Rank 0 sends each line to ranks already waiting for it (they load before the first and
# answer each turn in step with it): longer means one is gone.
LINE_DEADLINE_SECONDS = 30.0
# Stands for an answer's content, to find the text the chat template puts before it.
ANSWER_MARK = "<mlx_lm answer>"


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """--draft-model, --prompt-lookup and --num-draft-tokens (read by load_with_speculation)."""
    parser.add_argument("--draft-model", default=None,
                        help="A smaller model sharing the tokenizer, for speculative decoding (default: none)")
    parser.add_argument("--prompt-lookup", action="store_true",
                        help="Speculative decoding without a draft model: draft the tokens that followed the "
                        "latest earlier occurrence of the last few tokens")
    parser.add_argument("--num-draft-tokens", type=positive_int, default=None,
                        help=f"At most this many tokens drafted per target forward (default: "
                        f"{DEFAULT_NUM_DRAFT_TOKENS}; needs --draft-model or --prompt-lookup)")


def check_speculation_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.draft_model is not None and args.prompt_lookup:
        parser.error("--prompt-lookup and --draft-model are two drafters; give one")
    if args.num_draft_tokens is not None and args.draft_model is None and not args.prompt_lookup:
        parser.error(f"--num-draft-tokens {args.num_draft_tokens} needs --draft-model or --prompt-lookup")


def load_with_speculation(
    args: argparse.Namespace, group: Optional[mx.distributed.Group] = None
) -> Tuple[nn.Module, TokenizerWrapper, Dict[str, Any]]:
    """Load --model and what speculation needs: (model, tokenizer, the keyword
    arguments of stream_generate that select speculation, empty without it).

    Over a `group` of more than one rank (mlx.launch) --model is sharded (split by
    layers with --pipeline), the draft loads whole on each rank and drafts a pinned
    number of tokens per round (see `distributed`)."""
    distributed_run = group is not None and group.size() > 1
    if distributed_run:
        if args.adapter_path is not None:
            raise ValueError(f"--adapter-path {args.adapter_path!r}: adapters are not sharded; under mlx.launch "
                             "fuse them first (mlx_lm.fuse) and give the fused model")
        tokenizer_config = {"trust_remote_code": True} if args.trust_remote_code else None
        model, tokenizer = sharded_load(args.model, **distributed.split_groups(group, args.pipeline),
                                        dtype=args.dtype, tokenizer_config=tokenizer_config)
    else:
        model, tokenizer = load(args.model, adapter_path=args.adapter_path, dtype=args.dtype,
                                trust_remote_code=args.trust_remote_code)
    speculation: Dict[str, Any] = {}
    if args.draft_model is not None:
        draft_model, draft_tokenizer = load(args.draft_model, dtype=args.dtype,
                                            trust_remote_code=args.trust_remote_code)
        check_same_tokenizer(tokenizer, draft_tokenizer, args.model, args.draft_model)
        speculation.update(draft_model=draft_model,
                           num_draft_tokens=args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
    if args.prompt_lookup:
        speculation.update(prompt_lookup=True, num_draft_tokens=args.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
    if speculation and distributed_run:  # the adaptive policy times rounds on each rank's clock
        speculation["adaptive_draft_length"] = False
    return model, tokenizer, speculation


def read_system_prompt(value: Optional[str]) -> Optional[str]:
    """--system-prompt: the text itself, or the name of a file holding it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text().strip() if path.is_file() else value


@dataclass
class TurnStats:
    """How a turn's prompt was processed: tokens taken from the cache, tokens fed, and
    the seconds until the first token of the answer."""

    num_reused: int
    num_fed: int
    prompt_seconds: float = 0.0

    @property
    def prompt_tps(self) -> float:
        return self.num_fed / self.prompt_seconds if self.prompt_seconds else 0.0


class ChatSession:
    """A conversation and the prompt caches that hold it (see the module docstring).

    `generation_kwargs` go to stream_generate every turn (sampler, and speculation's
    `draft_model` or `prompt_lookup`, `num_draft_tokens`; a prompt lookup sees the whole
    conversation); with a `draft_model` a cache is the target's
    entries followed by the draft's, as speculation expects. `stored` keeps the caches
    by the tokens they hold: after a turn, the one holding the conversation so far,
    and for a cache that may not trim (recurrent states, sliding windows) a copy at the
    end of the turn's prompt but its last token, where the next turn restarts if its
    rendering of the answer differs from the tokens generated. `held` is what the
    conversation's cache holds (the last turn's prompt and answer tokens), which the next
    turn keeps where it can (`render`). `last_turn` tells how the last turn's prompt was
    processed. `prefill_step_size`: prompt tokens per forward (fewer: less peak memory)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        system_prompt: Optional[str] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_kv_size: Optional[int] = None,
        generation_kwargs: Optional[Dict[str, Any]] = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    ) -> None:
        if not tokenizer.has_chat_template:
            raise ValueError("chat needs a tokenizer with a chat template; this model's tokenizer has none")
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
        if "prefill_step_size" in (generation_kwargs or {}):  # it also chunks the caches kept (_store_prompt)
            raise ValueError("give prefill_step_size as ChatSession's own argument, not in generation_kwargs")
        self.prefill_step_size = prefill_step_size
        self.model, self.tokenizer = model, tokenizer
        self.system_prompt, self.max_tokens, self.max_kv_size = system_prompt, max_tokens, max_kv_size
        self.generation_kwargs = dict(generation_kwargs or {})
        self.last_turn: Optional[TurnStats] = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and its caches."""
        self.messages: List[Dict[str, str]] = []
        if self.system_prompt is not None:
            self.messages.append({"role": "system", "content": self.system_prompt})
        self.stored = LRUPromptCache(max_size=2)
        self.held: List[int] = []

    def models(self) -> List[nn.Module]:
        """The models whose entries make up a cache: the target, then any draft."""
        draft_model = self.generation_kwargs.get("draft_model")
        return [self.model] if draft_model is None else [self.model, draft_model]

    def new_cache(self) -> List[Any]:
        return [c for m in self.models() for c in make_prompt_cache(m, self.max_kv_size)]

    def render(self, messages: List[Dict[str, str]]) -> Tuple[str, List[int]]:
        """`messages` under the chat template, ready for the answer: (the text, its ids).
        The ids start with `held` (or `held` but a final EOS) where the text continues
        theirs, and always decode to the text."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ends_with_eos = bool(self.held) and self.held[-1] in self.tokenizer.eos_token_ids
        for held in (self.held, self.held[:-1]) if ends_with_eos else (self.held,):
            held_text = self.tokenizer.decode(held)
            if held and text.startswith(held_text):
                tokens = held + self.tokenizer.encode(text[len(held_text):], add_special_tokens=False)
                # Encoding the rest alone may add to it (a SentencePiece leading space), and
                # decoding turns bytes that are no UTF-8 (an answer cut inside a character)
                # into U+FFFD, so a text holding one may stand for other bytes than it shows.
                if self.tokenizer.decode(tokens) == text and "\ufffd" not in text:
                    return text, tokens
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def _answer_lead(self, messages: List[Dict[str, str]], prompt: str) -> str:
        """The text the template puts between `prompt` (the rendering of `messages` with
        the generation prompt) and an answer's content: "" when the generation prompt
        ends where answers start, "\n" for one that joins the messages by newlines and
        has no generation prompt."""
        with_answer = messages + [{"role": "assistant", "content": ANSWER_MARK}]
        before = self.tokenizer.apply_chat_template(with_answer, tokenize=False).partition(ANSWER_MARK)[0]
        return before[len(prompt):] if before.startswith(prompt) else ""

    def reply(self, text: str) -> Generator[GenerationResponse, None, None]:
        """Answer the user turn `text`, one response per token (the last one carries the
        finish_reason). Closing the generator early keeps the answer so far. A turn that
        fails leaves the conversation as it was."""
        messages = self.messages + [{"role": "user", "content": text}]
        prompt, tokens = self.render(messages)
        lead = self._answer_lead(messages, prompt)
        tic = time.perf_counter()
        fetched = self.stored.fetch(tokens)
        # Only the copy holds its arrays now, so feeding it need not copy them first.
        self.stored.trim_to(n_sequences=0)
        prompt_cache = fetched.prompt_cache or self.new_cache()
        self.last_turn = TurnStats(fetched.num_cached, len(fetched.remaining))
        generated: List[int] = []
        answer, clean_stop = "", False
        try:
            remaining = self._store_prompt(tokens, fetched.remaining, prompt_cache)
            kwargs = dict(self.generation_kwargs)
            if kwargs.pop("prompt_lookup", False):
                # The lookup also sees the conversation already in the cache.
                kwargs["drafter"] = PromptLookup(context=tokens[: len(tokens) - len(remaining)])
            with contextlib.closing(stream_generate(
                self.model, self.tokenizer, remaining, max_tokens=self.max_tokens,
                prompt_cache=prompt_cache, prefill_step_size=self.prefill_step_size, **kwargs,
            )) as responses:
                for response in responses:
                    if not generated:
                        self.last_turn.prompt_seconds = time.perf_counter() - tic
                    generated.append(response.token)
                    answer += response.text
                    yield response
            clean_stop = True
        except GeneratorExit:
            clean_stop = True  # closed at a yield: the cache holds every token delivered
            raise
        finally:
            if clean_stop:
                content = answer[len(lead):] if lead and answer.startswith(lead) else answer
                self.messages = messages + [{"role": "assistant", "content": content}]
                self.held = tokens + generated
                self.stored.insert(self.held, prompt_cache)

    def _store_prompt(self, tokens: List[int], remaining: List[int], prompt_cache: List[Any]) -> List[int]:
        """For a cache that may not trim back once the answer is in (anything but plain
        KVCache entries), feed all of `remaining` but its last token and store a copy
        holding `tokens[:-1]`. Returns what is left to feed."""
        if len(tokens) < 2 or all(type(c) is KVCache for c in prompt_cache):
            return remaining
        ids, start = mx.array(remaining[:-1], mx.uint32), 0
        for model in self.models():
            end = start + len(model.layers)
            model_ids = ids_within(ids, model.args.vocab_size).tolist()  # as speculation feeds a smaller draft
            fill_cache(model, model_ids, prompt_cache[start:end], _no_quantization, self.prefill_step_size)
            start = end
        self.stored.insert(tokens[:-1], copy_prompt_cache(prompt_cache))
        return remaining[-1:]


def _no_quantization(prompt_cache: List[Any]) -> None:
    """chat keeps the KV cache unquantized (fill_cache's quantize_kv hook)."""


def format_turn_stats(response: GenerationResponse, turn: TurnStats) -> str:
    """The --verbose line after an answer."""
    line = (
        f"[prompt: {turn.num_fed} new tokens + {turn.num_reused} from the cache, "
        f"{turn.prompt_tps:.1f} tokens-per-sec; generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.1f} tokens-per-sec; peak memory: {response.peak_memory:.3f} GB"
    )
    spec = response.speculation
    if spec is not None:
        line += f"; drafts accepted: {spec.num_accepted}/{spec.num_drafted}"
    return line + "]"


def print_commands(say: Callable[..., None] = print) -> None:
    say("Commands: 'q' or 'exit' ends the chat, 'r' starts a new one, 'h' shows this list.")


def read_line(group: mx.distributed.Group) -> Optional[str]:
    """The next line of stdin as rank 0 reads it, on every rank of `group` (None: the
    input ended), so every rank runs the same command or turn."""
    line = None
    if group.rank() == 0:
        try:
            line = input(">> ")
        except EOFError:
            print()
    if group.size() == 1:
        return line
    return distributed.broadcast_object(line, group, sender_deadline=LINE_DEADLINE_SECONDS,
                                        what="sending the line to the other ranks")


def chat_loop(session: ChatSession, verbose: bool, group: Optional[mx.distributed.Group] = None) -> None:
    """Answer the lines of stdin until the input ends or a quit command. Over a `group`
    of ranks (mlx.launch; default: the global group) rank 0 reads them, every rank
    answers and rank 0 prints."""
    group = distributed.world() if group is None else group
    say = distributed.printer(group)
    if group.size() > 1:
        distributed.wait_for_all(group)  # every rank loaded: read_line's deadline starts now
    while True:
        line = read_line(group)
        if line is None:
            return
        query = line.strip()
        if not query:
            continue
        if query in QUIT_COMMANDS:
            return
        if query == RESET_COMMAND:
            session.reset()
            say("[chat reset]")
            continue
        if query == HELP_COMMAND:
            print_commands(say)
            continue
        try:
            for response in session.reply(line):
                say(response.text, end="", flush=True)
        except KeyboardInterrupt:  # Ctrl-C stops the answer, not the chat
            if group.size() > 1:
                raise SystemExit("Error: answer interrupted; under mlx.launch every rank must finish each "
                                 "answer, so the chat ends") from None
            print("\n[answer interrupted; this turn is left out of the conversation]")
            continue
        say()
        if verbose:
            say(format_turn_stats(response, session.last_turn))


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx_lm.chat", description="Chat with an LLM", formatter_class=HelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Local model directory or Hugging Face repo id")
    parser.add_argument("--adapter-path", default=None,
                        help="LoRA/DoRA adapters for --model (adapter_config.json + adapters.safetensors)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Let the tokenizers run their repo's own code (transformers' option)")
    parser.add_argument("--temp", type=float, default=DEFAULT_TEMP, help="Sampling temperature")
    parser.add_argument("--top-p", type=float, default=DEFAULT_TOP_P, help="Nucleus sampling threshold")
    parser.add_argument("--xtc-probability", type=float, default=DEFAULT_XTC_PROBABILITY,
                        help="Probability of XTC sampling")
    parser.add_argument("--xtc-threshold", type=float, default=DEFAULT_XTC_THRESHOLD,
                        help="Probability threshold of XTC sampling")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="PRNG seed")
    parser.add_argument("--max-kv-size", type=positive_int, default=None,
                        help="Bound every KV cache to this many tokens, keeping the first 4 (default: unbounded)")
    parser.add_argument("--max-tokens", "-m", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="Maximum tokens per answer")
    parser.add_argument("--prefill-step-size", type=positive_int, default=DEFAULT_PREFILL_STEP_SIZE,
                        help="Prompt tokens per forward; fewer lower the peak memory of long prompts")
    parser.add_argument("--system-prompt", default=None,
                        help="System prompt for the chat template: the text, or a file holding it")
    parser.add_argument("--verbose", type=str2bool, nargs="?", const=True, default=False,
                        help="After each answer print the prompt tokens fed and reused, speeds and memory")
    parser.add_argument("--pipeline", action="store_true", help="Under mlx.launch, split the model's layers "
                        "across the ranks (pipeline parallel) instead of sharding every layer")
    add_speculation_arguments(parser)
    add_dtype_argument(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    check_speculation_arguments(parser, args)
    group = distributed.world()
    try:
        with distributed.fail_together(group):
            if group.size() > 1:  # every rank samples from rank 0's seed
                args.seed = distributed.shared_seed(args.seed, group)
            run(args, group)
            if group.size() > 1:
                distributed.wait_for_all(group)
    except (ValueError, FileNotFoundError) as e:  # e.g. a model whose caches cannot roll back, with a draft
        sys.exit(f"Error: {e}")


def run(args: argparse.Namespace, group: mx.distributed.Group) -> None:
    """Load the model (and draft) and chat as the parsed command line says."""
    mx.random.seed(args.seed)
    model, tokenizer, speculation = load_with_speculation(args, group)
    sampler = make_sampler(
        args.temp, args.top_p, xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n", add_special_tokens=False) + sorted(tokenizer.eos_token_ids),
    )
    session = ChatSession(
        model, tokenizer, system_prompt=read_system_prompt(args.system_prompt), max_tokens=args.max_tokens,
        max_kv_size=args.max_kv_size, generation_kwargs=dict(sampler=sampler, **speculation),
        prefill_step_size=args.prefill_step_size,
    )
    say = distributed.printer(group)
    say(f"[INFO] Chatting with {args.model}.")
    if group.size() > 1 and args.verbose:
        say(distributed.split_line(model, group, args.pipeline))
    print_commands(say)
    chat_loop(session, args.verbose, group)


if __name__ == "__main__":
    main()
