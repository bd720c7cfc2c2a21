"""How far the gradient of a micro-step cut into pieces (--micro_batch_tokens) is from the uncut one.

    python tools/micro_batch_distance.py CHECKPOINT --train_files 'data/novels/novels_train_*.bin' \\
        --micro_batch_tokens 2048 1024 --micro_steps 8

Takes --micro_steps micro-steps of the checkpoint's batch size at its step (one process) from the training
shards and, with the checkpoint's model in training mode on the CPU path, prints per cap the mean relative
distance |g_pieces - g| / |g| of the gradients and the relative change of the loss: for the trainer's cuts
(fixed positions, mostly through documents) and for the same number of cuts moved to the nearest document
start (what remains there: the smear gate, the key shift and the rotary tables across the cut). For scale it
also prints the distance between the gradients of consecutive micro-steps (batch noise).
"""
import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from sample import checkpoint_hyperparameters, load_model  # noqa: E402


def gradient(model, pieces, windows, mtp):
    """(summed loss, flat gradient) of one micro-step run as `pieces`."""
    model.zero_grad()
    loss = 0.0
    for piece in pieces:
        piece_loss = model(piece.inputs, piece.targets, piece.cu_seqlens, windows, piece.bigram_ids, mtp)
        piece_loss.backward()
        loss += piece_loss.item()
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()])


def pieces_at(window, lengths, cuts, bigram_rows):
    """The micro-step `window` cut at `cuts`, its bigram ids hashed over the whole micro-step (as the loader)."""
    edges = [0, *cuts, len(window) - 1]
    bigram_ids = tg.bigram_hash(window[:-1], bigram_rows) if bigram_rows else None
    return [tg.model_inputs(window[a: b + 1], tg.cut_lengths(lengths, a, b), torch.device("cpu"),
                            None if bigram_ids is None else bigram_ids[a:b])
            for a, b in zip(edges[:-1], edges[1:])]


def nearest_document_starts(lengths, cuts):
    starts = np.cumsum(lengths)[:-1]
    return sorted({int(starts[np.argmin(np.abs(starts - c))]) for c in cuts})


def main(argv=None):
    parser = argparse.ArgumentParser(prog="micro_batch_distance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--train_files", required=True, help="glob of training shards")
    parser.add_argument("--micro_batch_tokens", type=int, nargs="+", required=True, help="caps to compare")
    parser.add_argument("--micro_steps", type=int, default=8, help="micro-steps to average over (default: 8)")
    args = parser.parse_args(argv)
    snap = tg.load_checkpoint(args.checkpoint)
    hp = checkpoint_hyperparameters(snap)
    model = load_model(args.checkpoint, snap, hp, torch.device("cpu")).train()
    step, rows_bigram = snap["step"], hp.bigram_vocab_size
    windows = tg.window_blocks_at(step, hp)
    mtp = torch.tensor(tg.mtp_weights_at(step, hp)) if tg.multi_token_prediction(hp) else None
    tokens = tg.batch_size_at(step, hp) // tg.grad_accum_steps(hp, 1)
    loader = tg.TrainLoader(args.train_files, 0, 1, torch.device("cpu"), bigram_rows=rows_bigram)
    rows, previous = {}, None
    for _ in range(args.micro_steps):
        batch = loader.next_batch(tokens, tg.max_seq_len_at(step, hp))
        window = np.append(batch.inputs.numpy(), batch.targets[-1].item())
        lengths = np.diff(np.unique(batch.cu_seqlens.numpy()))
        loss, g = gradient(model, [batch], windows, mtp)
        if previous is not None:
            rows.setdefault("consecutive micro-steps (batch noise)", []).append(
                ((g - previous).norm() / g.norm()).item())
        previous = g
        for cap in args.micro_batch_tokens:
            fixed = [a for a, _ in tg.piece_bounds(tokens, cap)][1:]
            for name, cuts in ((f"cap {cap}: the trainer's cuts", fixed),
                               (f"cap {cap}: cuts moved to document starts", nearest_document_starts(lengths, fixed))):
                cut_loss, cut_g = gradient(model, pieces_at(window, lengths, cuts, rows_bigram), windows, mtp)
                rows.setdefault(name, []).append(((cut_g - g).norm() / g.norm()).item())
                rows.setdefault(name + " (loss)", []).append(abs(cut_loss - loss) / loss)
    loader.close()
    print(f"checkpoint step {snap['step']}, micro-steps of {tokens} tokens, {args.micro_steps} of them, windows {windows}")
    for name, values in rows.items():
        print(f"  {name:<60} mean {np.mean(values):.2e}  max {np.max(values):.2e}")


if __name__ == "__main__":
    main()
