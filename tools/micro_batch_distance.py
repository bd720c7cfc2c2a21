"""How far the gradient of a micro-step cut into pieces (--micro_batch_tokens) is from the uncut one.

    python tools/micro_batch_distance.py CHECKPOINT --train_files 'data/novels/novels_train_*.bin' \\
        --micro_batch_tokens 2048 1024 --micro_steps 8

Takes --micro_steps micro-steps of the checkpoint's batch size at its step (one process) from the training
shards and, with the checkpoint's model in training mode on the CPU path, prints per cap the mean relative
distance |g_pieces - g| / |g| of the gradients and the relative change of the loss, for the pieces the trainer
runs (whole documents, each piece carrying the document before it, its next two targets and its rotary
positions), and for the same pieces with the key shift closed in both runs (what is left then: fp32 rounding
and the bf16 rounding of the gradients of the lambdas the model uses in bf16, once per piece; with the key
shift open also the previous document's own first key, which the piece does not carry). For scale it also prints the
distance between the gradients of consecutive micro-steps (batch noise).
"""
import argparse
import contextlib
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from sample import open_checkpoint  # noqa: E402


def gradient(model, pieces, windows, mtp):
    """(summed loss, flat gradient) of one micro-step run as `pieces` (the model's loss adds the
    checkpoint's prior, if any)."""
    model.zero_grad()
    loss = 0.0
    for piece in pieces:
        piece_loss = model(piece.inputs, piece.targets, piece.cu_seqlens, windows, piece.bigram_ids, mtp,
                           piece.positions, piece.loss_mask)
        piece_loss.backward()
        loss += piece_loss.item()
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()])


def pieces_of(window, lengths, cap, bigram_rows, max_seq_len):
    """The micro-step `window` (documents `lengths`) as the trainer's pieces of at most `cap` tokens, its bigram
    ids hashed over the whole micro-step (as the loader)."""
    tokens = len(window) - 1
    bigram_ids = tg.bigram_hash(window[:-1], bigram_rows) if bigram_rows else None
    bounds, _ = tg.pack_documents(tg.cut_lengths(lengths, 0, tokens), cap)
    length = tg.padded_piece_length(tokens, cap, max_seq_len)
    return [tg.piece_inputs(window, lengths, a, b, length, torch.device("cpu"), bigram_ids) for a, b in bounds]


@contextlib.contextmanager
def key_shift_closed(model):
    """The model with no layer's key shift (its LayerPlans changed for the duration)."""
    plan = model.plan
    model.plan = [layer._replace(key_shift=False) for layer in plan]
    try:
        yield
    finally:
        model.plan = plan


def main(argv=None):
    parser = argparse.ArgumentParser(prog="micro_batch_distance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--train_files", required=True, help="glob of training shards")
    parser.add_argument("--micro_batch_tokens", type=int, nargs="+", required=True, help="caps to compare")
    parser.add_argument("--micro_steps", type=int, default=8, help="micro-steps to average over (default: 8)")
    args = parser.parse_args(argv)
    snap, hp, model, _ = open_checkpoint(args.checkpoint, "cpu")
    model.train()
    step, rows_bigram = snap["step"], hp.bigram_vocab_size
    plan = tg.Schedule(hp).at(step)
    windows, mtp = plan.windows, plan.mtp_weights
    tokens = plan.batch_tokens // tg.grad_accum_steps(hp, 1)
    loader = tg.TrainLoader(args.train_files, 0, 1, torch.device("cpu"), bigram_rows=rows_bigram)
    rows, previous = {}, None
    for _ in range(args.micro_steps):
        batch = loader.next_batch(tokens, plan.max_seq_len)
        window = np.append(batch.inputs.numpy(), batch.targets[-1].item())
        lengths = np.diff(np.unique(batch.cu_seqlens.numpy()))
        loss, g = gradient(model, [batch], windows, mtp)
        if previous is not None:
            rows.setdefault("consecutive micro-steps (batch noise)", []).append(
                ((g - previous).norm() / g.norm()).item())
        previous = g
        for cap in args.micro_batch_tokens:
            pieces = pieces_of(window, lengths, cap, rows_bigram, plan.max_seq_len)
            for name, closed in ((f"cap {cap}: the trainer's pieces", False), (f"cap {cap}: key shift closed", True)):
                with key_shift_closed(model) if closed else contextlib.nullcontext():
                    base_loss, base_g = gradient(model, [batch], windows, mtp) if closed else (loss, g)
                    cut_loss, cut_g = gradient(model, pieces, windows, mtp)
                rows.setdefault(name, []).append(((cut_g - base_g).norm() / base_g.norm()).item())
                rows.setdefault(name + " (loss)", []).append(abs(cut_loss - base_loss) / base_loss)
    loader.close()
    print(f"checkpoint step {snap['step']}, micro-steps of {tokens} tokens, {args.micro_steps} of them, windows {windows}")
    for name, values in rows.items():
        print(f"  {name:<60} mean {np.mean(values):.2e}  max {np.max(values):.2e}")


if __name__ == "__main__":
    main()
