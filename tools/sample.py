"""Look at what a checkpoint of train_gpt.py learned: continue a prompt, or score the checkpoint on any shards.

    python tools/sample.py CHECKPOINT --prompt "It was a dark night" --max_new_tokens 200 --temperature 0.8 \\
        --top_k 50 --seed 0 --bpe path/to/r50k_base.tiktoken
    python tools/sample.py CHECKPOINT --eval 'data/novels/novels_val_*.bin'

Any checkpoint of this trainer loads, whatever number of processes wrote it (a checkpoint holds the full
model). The model runs its own forward (through train_gpt.next_token_logits) with the attention
windows and YaRN state of the checkpoint's step, on the CPU path's attention (tiled SDPA, any device).
Sampling is deterministic for a --seed on a given device; the text goes to stdout, tokens/s to stderr.
Generation stops at the end of a document (<|endoftext|>) or at the model's --max_seq_len.

--eval GLOB prints the mean loss per token over the first --eval_tokens tokens of the shards (default: the
checkpoint's --val_tokens, fewer if the shards hold fewer) with the final validation's windows, in
forwards of the trainer's size on one process: on the checkpoint's own validation shards it is the last
val_loss of its log.

Prompts are encoded with the GPT-2 BPE: --bpe PATH names the offline r50k_base.tiktoken ranks file (as
data/fineweb.py takes it); without it tiktoken's cached or downloaded gpt2 encoding is used. Bad input (a
missing, corrupt or foreign checkpoint, an empty prompt or one longer than the model takes, no encoding)
is one line `sample.py: error: ...` on stderr and exit status 2.
"""
import argparse
import glob
import math
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()  # before the imports: the start-up figure counts them
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "data")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from shards import CliParser, describe_os_error, exit_with_error, validate_shard  # noqa: E402

PROG = "sample.py"


def build_parser():
    parser = CliParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint written by train_gpt.py (--save_every, --save_checkpoint)")
    parser.add_argument("--prompt", help="text to continue (the model sees it as the start of a document)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0: greedy (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when present, else CPU (default: auto)")
    parser.add_argument("--cpu_threads", type=int, default=1,
                        help="torch threads on CPU (default: 1; the model's operations are too small to share, and a "
                             "second thread on a busy machine waits for its turn at every one of them)")
    parser.add_argument("--bpe", metavar="PATH", help="r50k_base.tiktoken ranks file for offline use (sha256 checked)")
    parser.add_argument("--eval", metavar="GLOB", help="print the mean loss on these shards instead of sampling")
    parser.add_argument("--eval_tokens", type=int, default=0,
                        help="tokens to score with --eval (default 0: the checkpoint's --val_tokens)")
    return parser


def check_args(args):
    if args.eval is None and args.prompt is None:
        raise tg.ConfigError("pass --prompt TEXT to sample, or --eval GLOB to score shards")
    if args.prompt is not None and not args.prompt.strip():
        raise tg.ConfigError("--prompt is empty; give the model some text to continue")
    for name, ok, meaning in (("max_new_tokens", args.max_new_tokens > 0, "must be positive"),
                              ("temperature", math.isfinite(args.temperature) and args.temperature >= 0,
                               "must be a finite number >= 0 (0: the likeliest token each time)"),
                              ("top_k", args.top_k >= 0, "must be >= 0"),
                              ("eval_tokens", args.eval_tokens >= 0, "must be >= 0"),
                              ("cpu_threads", args.cpu_threads > 0, "must be positive")):
        if not ok:
            raise tg.ConfigError(f"--{name} {meaning}, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise tg.ConfigError("--device cuda, but no CUDA device is visible; use --device cpu or auto")


def checkpoint_hyperparameters(snap):
    """The checkpoint's Hyperparameters. Fields an older script did not have keep their defaults, those of
    the retie recipe for a script from before --recipe (which had only that model)."""
    saved = snap["hyperparameters"]
    values = tg.dataclasses.asdict(tg.Hyperparameters())
    if "recipe" not in saved:
        values.update(tg.RECIPES["retie"], recipe="retie")
    known = set(values)
    values.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})
    return tg.Hyperparameters(**values)


def load_model(path, snap, hp, device):
    """The checkpoint's model in eval mode, fp32, with the CPU path's attention (any device) and the rotary
    state (YaRN) of the checkpoint's step."""
    model = tg.use_cpu_fallbacks(tg.new_model(hp))
    try:
        model.load_state_dict(snap["model"])
    except (RuntimeError, KeyError, TypeError) as e:
        raise tg.DataError(f"{path}: its model state does not fit the model its settings describe "
                           f"({str(e).splitlines()[0][:120]}); was it written by another version of train_gpt.py?")
    model.rotary.follow_window(tg.window_blocks_at(snap["step"], hp)[1] * hp.window_block_tokens)
    return model.to(device).eval()


def prompt_ids(enc, prompt, max_seq_len):
    ids = [tg.BOS_ID] + enc.encode_ordinary(prompt)
    if len(ids) >= max_seq_len:
        raise tg.ConfigError(f"the prompt is {len(ids)} tokens with the document token, but the model takes documents "
                             f"of at most {max_seq_len} (its --max_seq_len) and needs room for one new token")
    return ids


def next_token(logits, temperature, top_k, generator):
    """A token id drawn from softmax(logits / temperature) over the top_k likeliest (argmax at temperature 0)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model, ids, hp, windows, args, device):
    """(new token ids, why generation stopped): until --max_new_tokens, a document end or --max_seq_len."""
    generator = torch.Generator(device).manual_seed(args.seed)
    ids, new = list(ids), []
    while len(new) < args.max_new_tokens:
        if len(ids) == hp.max_seq_len:
            return new, f"stopped at the model's {hp.max_seq_len}-token document limit (--max_seq_len)"
        window = np.array(ids + [tg.BOS_ID])  # the last entry is only the unused target of the last position
        bigram_ids = tg.bigram_hash(window[:-1], hp.bigram_vocab_size) if hp.bigram_vocab_size else None
        batch = tg.model_inputs(window, [len(ids)], device, bigram_ids)
        logits = tg.next_token_logits(model, batch, windows)[: hp.vocab_size]
        token = next_token(logits, args.temperature, args.top_k, generator)
        if token == tg.BOS_ID:
            return new, "stopped at the end of the document (<|endoftext|>)"
        ids.append(token)
        new.append(token)
    return new, None


def sample(args, enc, snap, hp, device):
    model = load_model(args.checkpoint, snap, hp, device)
    ids = prompt_ids(enc, args.prompt, hp.max_seq_len)
    windows = tg.window_blocks_at(snap["step"], hp)
    start = time.perf_counter()
    new, stopped = generate(model, ids, hp, windows, args, device)
    seconds = time.perf_counter() - start
    print(enc.decode(ids[1:] + new))
    print(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s) on {device}; checkpoint step "
          f"{snap['step']}, windows {windows[0]}/{windows[1]} blocks of {hp.window_block_tokens}"
          + (f"; {stopped}" if stopped else ""), file=sys.stderr)


def shard_tokens(pattern):
    """Tokens in the shards matching `pattern` (headers and sizes checked)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise tg.DataError(f"--eval {pattern!r} matches no file")
    return sum(validate_shard(path, check_tokens=False) for path in files)


@torch.no_grad()
def evaluate(args, snap, hp, device):
    """Mean loss per token over the first eval tokens of the shards, in forwards of the trainer's size."""
    model = load_model(args.checkpoint, snap, hp, device)
    available = shard_tokens(args.eval) - 1  # the last target needs one more token
    wanted = min(args.eval_tokens or hp.val_tokens, available)
    chunk = min(tg.tokens_per_rank(hp.val_batch_size, 1, tg.grad_accum_steps(hp, 1), what="--val_batch_size"), wanted)
    count = wanted // chunk * chunk
    if count <= 0:
        raise tg.DataError(f"--eval {args.eval!r} holds {available + 1} tokens; scoring needs at least 2")
    tokens = tg.read_validation_tokens(args.eval, count + 1, hp.vocab_size)
    windows = tg.final_window_blocks(hp)
    losses = [model(b.inputs, b.targets, b.cu_seqlens, windows, b.bigram_ids)
              for b in tg.validation_batches(tokens, count, chunk, 0, 1, 1, device, hp.bigram_vocab_size)]
    loss = torch.stack(losses).mean().item()
    print(f"val_loss:{loss:.4f} over {count:,} tokens of {args.eval} ({chunk:,} per forward, windows "
          f"{windows[0]}/{windows[1]} blocks of {hp.window_block_tokens}; checkpoint step {snap['step']})")
    return loss


def main(argv=None, enc=None):
    """Sample or evaluate; `enc` (a tiktoken Encoding) replaces the GPT-2 BPE (tests)."""
    args = build_parser().parse_args(argv)
    threads = torch.get_num_threads()
    try:
        check_args(args)
        device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        if args.eval is None and enc is None:
            import fineweb  # data/fineweb.py: the GPT-2 BPE, offline from --bpe
            enc = fineweb.load_encoding(args.bpe)
        torch.set_num_threads(args.cpu_threads)
        snap = tg.load_checkpoint(args.checkpoint)
        hp = checkpoint_hyperparameters(snap)
        if args.eval is not None:
            return evaluate(args, snap, hp, device)
        return sample(args, enc, snap, hp, device)
    except (tg.ConfigError, tg.DataError) as e:
        exit_with_error(PROG, e)
    except OSError as e:
        exit_with_error(PROG, describe_os_error(e))
    finally:
        torch.set_num_threads(threads)  # (main runs in the tests' process too)


if __name__ == "__main__":
    main()
