"""The CPU track's n-gram prior (train_gpt.py's --ngram_prior): n-gram counts, interpolated modified
Kneser-Ney (Chen & Goodman 1998) and NgramPrior, which adds a weighted log-probability of each next
token to the CPU loss's softcapped logits. tools/ngram_baseline.py scores the same count models.

train_gpt.py loads this file only when --ngram_prior is above 0, and the run's log carries it after
the script."""
import time
from typing import NamedTuple

import numpy as np
import torch

from train_gpt import BOS_ID, MAX_NGRAM_ORDER, ConfigError, DataError, padded_vocab, read_shard

NGRAM_TOKEN_BITS = 16  # shards hold uint16 tokens: an n-gram key packs its tokens 16 bits each


class NgramLevel(NamedTuple):
    """The distinct n-grams of one order n >= 2 of some token streams, sorted by (context,
    successor): the context's n - 1 tokens packed NGRAM_TOKEN_BITS each (the oldest highest), the
    successor token, the count, and the index of the n-gram's (n - 1)-token suffix among the order
    below's (for n = 2: the successor)."""
    contexts: np.ndarray  # uint64
    successors: np.ndarray  # int64
    counts: np.ndarray  # int64
    suffixes: np.ndarray  # int64


def check_ngram_tokens(tokens):
    if tokens.size and int(tokens.max()) >> NGRAM_TOKEN_BITS:
        raise DataError(f"n-gram counts pack tokens {NGRAM_TOKEN_BITS} bits each (as shards hold "
                        f"them), got token {int(tokens.max())}")


def unique_keys(keys, largest):
    """np.unique(keys, return_inverse=True, return_counts=True) of int64 keys in [0, largest]: where
    a key and its position fit in 64 bits together, one sort of (key, position) replaces unique's
    argsort (3x faster)."""
    position_bits = max(keys.size - 1, 1).bit_length()
    if int(largest).bit_length() + position_bits > 64:
        return np.unique(keys, return_inverse=True, return_counts=True)
    ordered = np.sort((keys.astype(np.uint64) << np.uint64(position_bits))
                      | np.arange(keys.size, dtype=np.uint64))
    sorted_keys = (ordered >> np.uint64(position_bits)).astype(np.int64)
    first = np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])) \
        if keys.size else np.zeros(0, np.int64)
    inverse = np.empty(keys.size, dtype=np.int64)
    inverse[(ordered & np.uint64((1 << position_bits) - 1)).astype(np.int64)] = np.repeat(
        np.arange(first.size), np.diff(np.append(first, keys.size)))
    return sorted_keys[first], inverse, np.diff(np.append(first, keys.size))


def count_ngrams(streams, vocab_size, order):
    """(the unigram counts (vocab_size,), [NgramLevel of orders 2 ... order]) of the n-grams inside
    each stream (a shard is one stream; its n-grams cross documents). Order n's key is (the index of
    the (n - 1)-gram that ends one token earlier among the distinct (n - 1)-grams, successor):
    sorting the keys sorts the n-grams by their tokens, and no key exceeds 64 bits at any vocabulary
    size."""
    if not 2 <= order <= MAX_NGRAM_ORDER:
        raise ValueError(f"n-gram order {order} outside 2 ... {MAX_NGRAM_ORDER}")
    streams = [np.asarray(s) for s in streams]
    tokens = np.concatenate(streams).astype(np.int64) if streams else np.zeros(0, np.int64)
    check_ngram_tokens(tokens)
    lengths = np.array([s.size for s in streams], dtype=np.int64)
    # tokens before, same stream
    depth = np.arange(tokens.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    # order 1: a token is its own id
    ids, packed, levels = tokens, np.arange(vocab_size, dtype=np.uint64), []
    n_ids = 1 << NGRAM_TOKEN_BITS
    for n in range(2, order + 1):
        ends = np.flatnonzero(depth >= n - 1)  # positions that end an n-gram
        keys = (ids[ends - 1] << NGRAM_TOKEN_BITS) | tokens[ends]
        distinct, inverse, counts = unique_keys(keys, (n_ids << NGRAM_TOKEN_BITS) - 1)
        suffixes = np.empty(distinct.size, dtype=np.int64)
        suffixes[inverse] = ids[ends]  # every position of one n-gram writes the same suffix
        successors = distinct & ((1 << NGRAM_TOKEN_BITS) - 1)
        contexts = packed[distinct >> NGRAM_TOKEN_BITS]
        levels.append(NgramLevel(contexts, successors, counts.astype(np.int64), suffixes))
        if n < order:
            ids = np.full(tokens.size, -1, dtype=np.int64)
            ids[ends], n_ids = inverse, distinct.size
            packed = (contexts << np.uint64(NGRAM_TOKEN_BITS)) | successors.astype(np.uint64)
    return np.bincount(tokens, minlength=vocab_size), levels


def kneser_ney_discounts(counts):
    """Modified Kneser-Ney's (D1, D2, D3+) from the count-of-counts n1 ... n4 of `counts` (Chen &
    Goodman 1998): Y = n1 / (n1 + 2 n2), Dk = k - (k + 1) Y n(k+1) / nk. On tiny corpora the formula
    can be undefined (some nk = 0: that discount is k / 2) or leave (0, k] (clipped to [0.01, k]: a
    context's back-off weight stays > 0)."""
    n = np.bincount(np.minimum(counts, 5), minlength=6)[1:5].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = n[0] / (n[0] + 2 * n[1])
        d = np.array([k - (k + 1) * y * n[k] / n[k - 1] for k in (1, 2, 3)])
    return np.where(np.isfinite(d), np.clip(d, 0.01, [1.0, 2.0, 3.0]), [0.5, 1.0, 1.5])


class KneserNeyLevel(NamedTuple):
    """Order n >= 2 of a KneserNey model: its seen contexts (packed as NgramLevel's, sorted), each
    context's successors (CSR: row_starts), the log of each context's back-off weight and each seen
    n-gram's correction."""
    contexts: np.ndarray  # uint64
    row_starts: np.ndarray  # int64, one more than contexts
    log_backoff: np.ndarray  # float64 per context, <= 0
    successors: np.ndarray  # int64 per n-gram
    corrections: np.ndarray  # float64 per n-gram, >= 0


class KneserNey(NamedTuple):
    """Interpolated modified Kneser-Ney (Chen & Goodman 1998) of order len(levels) + 1. With h_k the
    last k - 1 tokens of the context, P_k(w | h_k) = max(a(h_k w) - D(a), 0) / a(h_k .) + g(h_k)
    P_k-1(w | h_k-1) for a seen h_k, else P_k-1(w | h_k-1); a counts the n-gram at the top order and
    its distinct one-token left extensions below (continuation counts), g(h) = (D1 N1(h .) + D2 N2(h
    .) + D3+ N3+(h .)) / a(h .), and P_1 interpolates with the uniform distribution over the
    vocabulary. So log P(w | h) = log P_1(w) + the log back-off weights of h's seen suffixes + the
    corrections log(P_k / (g P_k-1)) of the seen n-grams h_k w: a dense row, a per-context offset
    and sparse corrections, all of which just add."""
    log_unigram: np.ndarray  # float64 (vocabulary,)
    levels: list  # KneserNeyLevel of orders 2 ... order
    discounts: np.ndarray  # (order, 3): D1, D2, D3+ of orders 1 ... order


def interpolated_unigram(counts, discounts):
    """Modified Kneser-Ney's lowest order: discounted continuation counts plus their mass spread
    uniformly."""
    total = counts.sum()
    if not total:
        return np.full(counts.size, 1.0 / counts.size)
    d = np.where(counts > 0, discounts[np.clip(counts, 1, 3) - 1], 0.0)
    return (counts - d) / total + d.sum() / total / counts.size


def kneser_ney_level(level, counts, discounts, log_p_lower):
    """(KneserNeyLevel, log P of each of its n-grams) of one order's n-grams with counts `counts`
    (all > 0) above the order whose log P of each n-gram (for order 2: of each token) is
    log_p_lower."""
    contexts = level.contexts
    starts = np.flatnonzero(np.concatenate([[True], contexts[1:] != contexts[:-1]])) \
        if contexts.size else np.zeros(0, np.int64)
    row = np.repeat(np.arange(starts.size), np.diff(np.append(starts, contexts.size)))
    d = discounts[np.minimum(counts, 3) - 1]
    totals = np.add.reduceat(counts, starts).astype(np.float64) if starts.size else np.zeros(0)
    backoff = np.add.reduceat(d, starts) / totals if starts.size else np.zeros(0)
    lower = log_p_lower[level.suffixes]
    corrections = np.log1p((counts - d) / totals[row] / (backoff[row] * np.exp(lower)))
    log_backoff = np.log(backoff)
    return (KneserNeyLevel(contexts[starts], np.append(starts, contexts.size), log_backoff,
                           level.successors, corrections), log_backoff[row] + lower + corrections)


def kneser_ney(unigrams, levels):
    """The KneserNey model of count_ngrams' (unigrams, levels): counts over the vocabulary, orders 2
    ... top."""
    levels = list(levels)
    continuation = np.bincount(levels[0].suffixes, minlength=unigrams.size)
    discounts = [kneser_ney_discounts(continuation[continuation > 0])]
    log_unigram = np.log(interpolated_unigram(continuation, discounts[0]))
    log_p, model_levels = log_unigram, []
    for n, level in enumerate(levels, start=2):
        top = n == len(levels) + 1
        counts = level.counts if top else np.bincount(levels[n - 1].suffixes,
                                                      minlength=level.counts.size)
        # below the top, an n-gram seen only at a stream's start has no continuation: unseen
        keep = counts > 0
        if not top:  # the order above indexes its suffixes among the n-grams kept here
            levels[n - 1] = levels[n - 1]._replace(
                suffixes=(np.cumsum(keep) - 1)[levels[n - 1].suffixes])
        level = NgramLevel(*(a[keep] for a in level[:3]), level.suffixes[keep])
        discounts.append(kneser_ney_discounts(counts[keep]))
        model_level, log_p = kneser_ney_level(level, counts[keep], discounts[-1], log_p)
        model_levels.append(model_level)
    return KneserNey(log_unigram, model_levels, np.array(discounts))


def ngram_context_rows(contexts, tokens):
    """(orders - 1, len(tokens)) int64: for each order n = 2, 3, ... (`contexts`: each order's
    sorted packed contexts) the row of the context of each position's next token: the n - 1 tokens
    up to and including it, or -1 where that context is unseen or not there. A context stops at the
    sequence's start and at a document token (it may start with one): a micro-step piece, which
    starts at a document, sees the same contexts."""
    tokens = np.asarray(tokens, dtype=np.int64)
    # a larger id (a model's vocabulary may reach it) was never counted
    fits = (tokens >> NGRAM_TOKEN_BITS) == 0
    index, rows = np.arange(tokens.size), []
    key, there = np.zeros(tokens.size, dtype=np.uint64), fits.copy()
    # the context's oldest token is `back` positions before
    for back, order_contexts in enumerate(contexts):
        if back:
            there[:back] = False
            there[back:] &= fits[:-back] & (tokens[1: tokens.size + 1 - back] != BOS_ID)
        key |= (np.where(there, tokens[np.maximum(index - back, 0)], 0).astype(np.uint64)
                << np.uint64(NGRAM_TOKEN_BITS * back))
        at = np.searchsorted(order_contexts, key).clip(max=max(order_contexts.size - 1, 0))
        found = (there & (order_contexts[at] == key) if order_contexts.size
                 else np.zeros(tokens.size, bool))
        rows.append(np.where(found, at, -1))
    return np.stack(rows) if rows else np.zeros((0, tokens.size), np.int64)


# the head's padding ids never occur: exp underflows to 0, and weight 0 still gives 0
PRIOR_PAD_LOG_PROB = -1e4


class NgramPrior:
    """weight x log P(w | context) of a KneserNey model as torch rows: the dense lowest-order row,
    and for each higher order its contexts' offsets (log back-off weights) and corrections on their
    seen successors (CSR)."""

    def __init__(self, model, weight, columns):
        as_tensor = lambda a: torch.tensor(weight * a, dtype=torch.float32)  # noqa: E731
        log_unigram = np.full(columns, PRIOR_PAD_LOG_PROB)
        log_unigram[: model.log_unigram.size] = model.log_unigram
        self.log_unigram = as_tensor(log_unigram)
        self.contexts = [level.contexts for level in model.levels]
        self.offsets = [as_tensor(level.log_backoff) for level in model.levels]
        self.row_starts = [torch.from_numpy(level.row_starts) for level in model.levels]
        self.successors = [torch.from_numpy(level.successors) for level in model.levels]
        self.corrections = [as_tensor(level.corrections) for level in model.levels]

    @staticmethod
    def bytes_bound(order, training_tokens, columns):
        """At most nbytes() of an order-`order` prior of training_tokens tokens: each order above
        the first has at most one context (key, offset, row start) and one n-gram (successor,
        correction) per token."""
        return 4 * columns + (order - 1) * training_tokens * (8 + 4 + 8 + 8 + 4)

    def nbytes(self):
        tensors = [self.log_unigram, *self.offsets, *self.row_starts, *self.successors,
                   *self.corrections]
        return (sum(t.numel() * t.element_size() for t in tensors)
                + sum(c.nbytes for c in self.contexts))

    def context_rows(self, tokens):
        """(orders - 1, len(tokens)) int64 tensor: ngram_context_rows of a sequence's input
        tokens."""
        return torch.from_numpy(ngram_context_rows(self.contexts, tokens.cpu().numpy()))

    def add_to(self, logits, context_rows):
        """logits (rows, columns) += the prior of the token after each row's context (context_rows'
        columns for these rows), in place; returns them. Two passes over the logits (the dense row,
        then each row's summed context offsets) and one scatter-add of every order's corrections."""
        shift = logits.new_zeros(logits.size(0))
        index, values = [], []
        for rows, offsets, row_starts, successors, corrections in zip(
                context_rows, self.offsets, self.row_starts, self.successors, self.corrections):
            seen = torch.nonzero(rows >= 0).squeeze(1)
            context = rows[seen]
            shift.index_add_(0, seen, offsets[context])
            starts, lengths = row_starts[context], row_starts[context + 1] - row_starts[context]
            row = torch.repeat_interleave(seen, lengths)
            # entry i of the flattened successor lists is number i - (entries before its row) of its
            # row
            first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
            at = first + torch.arange(row.numel())
            index.append(row * logits.size(1) + successors[at])
            values.append(corrections[at])
        logits.add_(self.log_unigram).add_(shift[:, None])
        if index:
            logits.view(-1).index_add_(0, torch.cat(index), torch.cat(values))
        return logits


def count_ngram_prior(hp, files, log=None):
    """--ngram_prior's NgramPrior (as wide as the head: padded_vocab) from every training shard's
    counts (the trainer counts on the clock, and a resumed run counts again: the prior is not in
    checkpoints)."""
    began = time.perf_counter()
    unigrams, levels = count_ngrams([read_shard(path, hp.vocab_size) for path in files],
                                    hp.vocab_size, hp.ngram_prior_order)
    counted = time.perf_counter() - began
    prior = NgramPrior(kneser_ney(unigrams, levels), hp.ngram_prior, padded_vocab(hp))
    if log is not None:
        log(f"ngram prior: counted {int(unigrams.sum()):,} training tokens "
            f"({levels[-1].counts.size:,} distinct {hp.ngram_prior_order}-grams) in {counted:.1f} "
            f"s, Kneser-Ney model in {time.perf_counter() - began - counted:.1f} s "
            f"({prior.nbytes() / 2**20:,.0f} MiB)")
    return prior


def ngram_count_bytes_floor(order, tokens):
    """The least peak of counting an order-`order` prior of `tokens` tokens (count_ngrams, then
    kneser_ney): its per-token arrays, whatever the text. Measured (tracemalloc, 200k-800k tokens)
    at orders 2/3/4/5: 83/117/146/180 bytes a token on Zipf-like tokens, up to 133/237/317/397 on
    tokens that never repeat; 35 per order above the first and 50 is below all of them."""
    return tokens * (50 + 35 * (order - 1))


def prior_fix(hp):
    return ("lower --ngram_prior_order, or pass --ngram_prior 0" if hp.ngram_prior_order > 2
            else "pass --ngram_prior 0")


def check_counting_fits(hp, tokens, available):
    """Refuse, at setup, a prior whose counting cannot fit `available` bytes (None: unknown) at its
    least peak."""
    need = ngram_count_bytes_floor(hp.ngram_prior_order, tokens)
    if available is not None and need > available:
        raise ConfigError(f"counting the --ngram_prior of {tokens:,} training tokens at "
                          f"--ngram_prior_order {hp.ngram_prior_order} needs at least "
                          f"{need / 2**30:.2f} GiB, but {available / 2**30:.2f} GiB are available; "
                          f"{prior_fix(hp)}")


def out_of_memory(hp, tokens):
    """The one-line error of a MemoryError while counting the prior of `tokens` tokens."""
    return ConfigError(f"ran out of memory counting the --ngram_prior of {tokens:,} training "
                       f"tokens at --ngram_prior_order {hp.ngram_prior_order}; {prior_fix(hp)}")
