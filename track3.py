"""Track 3, the optimizer race: Shampoo, SOAP and AdamW as train_gpt.py's --matrix_optimizer.

train_gpt.py loads this file only when --matrix_optimizer names one of OPTIMIZERS, and the run's log
carries it after the script. It adds the optimizers' flags to train_gpt's Hyperparameters and builds
on train_gpt's optimizer interface (ScheduledOptimizer) and its collectives.
"""
import heapq
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import train_gpt as tg
from train_gpt import (ScheduledOptimizer, adam_direction, ema_, ema_square_, hp_field,
                       stacked_groups, world_info)


@dataclass
class Hyperparameters(tg.Hyperparameters):
    """train_gpt's fields and the track-3 optimizers' (CLI flags as train_gpt's)."""
    shampoo_lr: float = hp_field(0.0015, "Shampoo learning rate")
    shampoo_betas: tuple = hp_field((0.9, 0.95), "Shampoo momentum and factor decay")
    shampoo_wd: float = hp_field(0.2, "Shampoo decoupled weight decay")
    shampoo_eps: float = hp_field(1e-12, "Shampoo epsilon added to the factors' eigenvalues")
    shampoo_precondition_frequency: int = hp_field(5, "Shampoo: steps between inverse-root "
                                                      "refreshes")
    shampoo_graft_beta2: float = hp_field(0.95, "Shampoo: second-moment decay of the Adam grafting")
    shampoo_graft_eps: float = hp_field(1e-10, "Shampoo: epsilon of the Adam grafting")
    factor_max_dim: int = hp_field(8192, "Shampoo and SOAP: largest factor dimension (blocks are "
                                         "cut to it)")
    factor_dtype: str = hp_field("fp32", "Shampoo and SOAP: dtype of the stored factors and "
                                         "roots/bases: fp32, bf16")
    factor_block_cost: str = hp_field("bytes", "Shampoo and SOAP: block cost for the rank "
                                               "assignment: bytes, poly")
    soap_lr: float = hp_field(0.003, "SOAP learning rate")
    soap_betas: tuple = hp_field((0.95, 0.95), "SOAP momentum and second-moment/factor decay")
    soap_wd: float = hp_field(0.01, "SOAP decoupled weight decay")
    soap_eps: float = hp_field(1e-8, "SOAP epsilon")
    soap_precondition_frequency: int = hp_field(10, "SOAP: steps between eigenbasis refreshes")
    adamw_lr: float = hp_field(0.0015, "AdamW learning rate (as the matrix optimizer)")
    adamw_betas: tuple = hp_field((0.9, 0.95), "AdamW betas")
    adamw_wd: float = hp_field(0.1, "AdamW decoupled weight decay")
    adamw_eps: float = hp_field(1e-8, "AdamW epsilon")


HP_SECTIONS = {"shampoo_lr": "track 3: the optimizers of --matrix_optimizer"}
# (flags, test, what the test means), as train_gpt.VALUE_RULES
VALUE_RULES = [
    (("shampoo_lr", "shampoo_graft_eps", "shampoo_precondition_frequency", "factor_max_dim",
      "soap_lr", "soap_eps", "soap_precondition_frequency", "adamw_lr", "adamw_eps"),
     lambda v: v > 0, "must be positive"),
    (("shampoo_wd", "shampoo_eps", "soap_wd", "adamw_wd"), lambda v: v >= 0, "must be >= 0"),
    (("shampoo_betas", "shampoo_graft_beta2", "soap_betas", "adamw_betas"), lambda v: 0 <= v < 1,
     "must be in [0, 1)"),
]
CHOICES = {"factor_dtype": ("fp32", "bf16"), "factor_block_cost": ("bytes", "poly")}


# Each parameter is cut into blocks (the merged attention weight into Q, K, V and O first); blocks
# go to ranks by a greedy heaviest-first assignment over a cost model; one reduce-scatter brings
# each rank the gradients of its blocks, one all-gather brings everyone the updated blocks.


def merge_dims(shape, max_dim, target=1):
    """Drop size-1 dimensions, then merge neighbours from the right while the product stays within
    max_dim and at least `target` dimensions remain: (1, 2, 5, 1) -> (10,); (32, 3, 64, 64) with
    max_dim 8192 and target 2 -> (96, 4096)."""
    dims = [d for d in shape if d > 1] or [1]
    merged = [dims[-1]]
    for i in range(len(dims) - 2, -1, -1):  # i dimensions are still to the left of this one
        if dims[i] * merged[0] <= max_dim and i + len(merged) >= target:
            merged[0] *= dims[i]
        else:
            merged.insert(0, dims[i])
    return tuple(merged)


def split_dims(shape, max_dim):
    """Blocks of at most max_dim along every dimension: a list of per-dimension slices per block
    (5 x 3 split by 2 -> 3 x 2 = 6 blocks)."""
    per_dim = [[slice(start, min(start + max_dim, size)) for start in range(0, size, max_dim)]
               for size in shape]
    blocks = [[]]
    for options in per_dim:
        blocks = [block + [s] for block in blocks for s in options]
    return [tuple(block) for block in blocks]


def block_cost(shape, model):
    """Relative work and memory of a block's preconditioner. 'bytes': its factor matrices in fp32,
    each side aligned to 8; 'poly': eigendecompositions (d^3 per side) plus applying them (numel x
    sum d)."""
    if model == "bytes":
        return sum(4 * (-(-d // 8) * 8) ** 2 for d in shape)
    return sum(d ** 3 for d in shape) + math.prod(shape) * sum(shape)


def assign_blocks(costs, numels, world_size, capacity=None):
    """Greedy, heaviest block first, to the rank with the least cost so far whose gradient elements
    stay within `capacity` (else to the rank with the fewest elements). Returns each block's
    rank."""
    owner = [0] * len(costs)
    heap = [(0.0, rank) for rank in range(world_size)]
    elements = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        skipped = []
        while heap:
            load, rank = heapq.heappop(heap)
            if capacity is None or elements[rank] + numels[i] <= capacity:
                break
            skipped.append((load, rank))
        else:  # nobody has room: the least-filled rank takes it (more padding)
            rank = min(range(world_size), key=lambda r: elements[r])
            load = next(l for l, r in skipped if r == rank)
            skipped.remove((load, rank))
        owner[i] = rank
        elements[rank] += numels[i]
        for item in skipped + [(load + costs[i], rank)]:
            heapq.heappush(heap, item)
    return owner


def symmetric_eigh(matrix):
    """(eigenvalues, eigenvectors) of a symmetric matrix in fp32, retried in fp64 when fp32 fails to
    converge."""
    try:
        return torch.linalg.eigh(matrix.float())
    except torch.linalg.LinAlgError:
        return tuple(t.float() for t in torch.linalg.eigh(matrix.double()))


def inverse_root(matrix, root, eps):
    """(matrix + eps I)^(-1/root) of a symmetric PSD matrix via its eigendecomposition."""
    values, vectors = symmetric_eigh(matrix)
    scale = (values.clamp_min(0) + eps).pow(-1 / root)
    return (vectors * scale) @ vectors.T


def gram(grad, side):
    """G Gᵀ (side 0) or Gᵀ G (side 1) of a 2-D block; g gᵀ of a 1-D one."""
    if grad.ndim == 1:
        return torch.outer(grad, grad)
    return grad @ grad.T if side == 0 else grad.T @ grad


@dataclass(frozen=True)
class ParamBlock:
    param: int  # index into the optimizer's parameters
    rows: slice  # the piece of the parameter (a Q/K/V/O quarter of the attention weight, or all)
    shape: tuple  # the piece viewed with merged dimensions
    index: tuple  # the block within that view
    numel: int

    def of(self, tensor):
        """The block as a view of `tensor` (the parameter or its gradient)."""
        return tensor[self.rows].view(self.shape)[self.index]


class BlockOptimizer(ScheduledOptimizer):
    """Blocks, their assignment to ranks and the communication of the track-3 optimizers; subclasses
    define the per-block update (`direction`). Each rank keeps state only for its own blocks. One lr
    for every matrix: NorMuon's per-parameter lr_mul and shape factor are part of NorMuon."""

    name = "block optimizer"

    def __init__(self, table, lr, betas, weight_decay, max_dim, cost):
        """table: [(parameter, ParamSpec)] (GPT.param_table's matrix part)."""
        self.rank, self.world_size = world_info()
        table = list(table)
        self.params = [p for p, _ in table]
        self.param_groups = [dict(params=self.params, lr=lr, initial_lr=lr, betas=betas,
                                  weight_decay=weight_decay)]
        self.blocks = []
        for index, (p, spec) in enumerate(table):
            pieces = spec.pieces
            height = p.shape[0] // pieces
            for piece in range(pieces):
                rows = slice(piece * height, (piece + 1) * height)
                shape = merge_dims((height, *p.shape[1:]), max_dim, target=2)
                for sub in split_dims(shape, max_dim):
                    numel = math.prod(s.stop - s.start for s in sub)
                    self.blocks.append(ParamBlock(index, rows, shape, sub, numel))
        # no rank receives more gradient elements than NorMuon sends it for the same parameters
        capacity = sum(-(-len(g) // self.world_size) * g[0].numel()
                       for g in stacked_groups(table, self.world_size)) \
            if self.world_size > 1 else None
        costs = [block_cost(tuple(s.stop - s.start for s in b.index), cost) for b in self.blocks]
        owner = assign_blocks(costs, [b.numel for b in self.blocks], self.world_size, capacity)
        self.rank_blocks = [[i for i, r in enumerate(owner) if r == rank]
                            for rank in range(self.world_size)]
        self.segment = max(sum(self.blocks[i].numel for i in mine) for mine in self.rank_blocks)
        self.step_count = 0
        self.state = {}  # block index -> its tensors (own blocks only)

    def _pack(self, get, rank_blocks, dtype):
        """The blocks' values (get(block) -> tensor) laid out rank after rank, padded to equal
        segments."""
        flat = torch.zeros(len(rank_blocks) * self.segment, dtype=dtype,
                           device=self.params[0].device)
        for rank, mine in enumerate(rank_blocks):
            offset = rank * self.segment
            for i in mine:
                block = self.blocks[i]
                flat[offset: offset + block.numel] = get(block).reshape(-1)
                offset += block.numel
        return flat

    @torch.no_grad()
    def update(self):
        self.step_count += 1
        group = self.param_groups[0]
        grads = self._pack(lambda b: b.of(self.params[b.param].grad), self.rank_blocks,
                           torch.float32)
        if self.world_size > 1:
            local = grads.new_empty(self.segment)
            dist.reduce_scatter_tensor(local, grads, op=dist.ReduceOp.AVG)
        else:
            local = grads
        mine = self.rank_blocks[self.rank]
        updated, offset = torch.zeros_like(local), 0
        for i in mine:
            block = self.blocks[i]
            p = self.params[block.param]
            g = local[offset: offset + block.numel].view(block.of(p).shape)
            weight = block.of(p).float()
            direction = self.direction(i, g)
            new = weight if direction is None else \
                weight * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * direction
            updated[offset: offset + block.numel] = new.reshape(-1)
            offset += block.numel
        full = updated
        if self.world_size > 1:
            full = updated.new_empty(self.world_size * self.segment)
            dist.all_gather_into_tensor(full, updated)
        for rank, blocks in enumerate(self.rank_blocks):
            offset = rank * self.segment
            for i in blocks:
                block = self.blocks[i]
                target = block.of(self.params[block.param])
                target.copy_(full[offset: offset + block.numel].view(target.shape))
                offset += block.numel

    def direction(self, i, grad):
        """The block's update direction from its averaged gradient (None: leave the block as it
        is)."""
        raise NotImplementedError

    def _new_state(self, grad):
        raise NotImplementedError

    def _block_state(self, i, grad):
        """Block i's state tensors, made (zeros) at its first step."""
        if i not in self.state:
            self.state[i] = self._new_state(grad)
        return self.state[i]

    def state_dict(self):
        """Every block's state (all ranks' gathered, keyed by block index: the same at any world
        size)."""
        state = {i: {k: v.cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in self.state.items()}
        if self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, state)
            state = {i: s for part in parts for i, s in part.items()}
        return {"name": self.name, "step": self.step_count, "blocks": state}

    def load_state_dict(self, state):
        if state.get("name") != self.name or any(i >= len(self.blocks) or not self._fits(i, s)
                                                 for i, s in state["blocks"].items()):
            raise ValueError(f"{self.name} state does not match this optimizer and model")
        self.step_count = state["step"]
        device = self.params[0].device
        self.state = {i: {k: v.to(device) if torch.is_tensor(v) else v
                          for k, v in state["blocks"][i].items()}
                      for i in self.rank_blocks[self.rank] if i in state["blocks"]}

    def _fits(self, i, block_state):
        """Whether a saved block state has the entries and shapes this optimizer makes for block i
        (a checkpoint of another version of the script may not)."""
        block = self.blocks[i]
        expected = self._new_state(torch.empty(block.of(self.params[block.param]).shape,
                                               device="meta"))
        return block_state.keys() == expected.keys() and \
            all(getattr(block_state[k], "shape", None) == getattr(expected[k], "shape", None)
                for k in expected)


class FactoredOptimizer(BlockOptimizer):
    """Shampoo's and SOAP's common part: per block, the factors L = EMA(G Gᵀ) and R = EMA(Gᵀ G) (one
    factor for a 1-D block), each with a matrix derived from it (`derived`: inverse root or
    eigenbasis), stored in `state_dtype` ("fp32" or "bf16"), plus momentum and an Adam-style second
    moment (`second`); subclasses name the last two state entries."""

    def __init__(self, params, lr, betas, weight_decay, eps, max_dim, precondition_frequency,
                 state_dtype="fp32", cost="bytes"):
        super().__init__(params, lr, betas, weight_decay, max_dim, cost)
        self.eps, self.frequency = eps, precondition_frequency
        self.state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]

    def _new_state(self, grad):
        state = {"momentum": torch.zeros_like(grad), self.second: torch.zeros_like(grad)}
        for d, size in enumerate(grad.shape):
            state[f"factor{d}"] = grad.new_zeros(size, size, dtype=self.state_dtype)
            state[f"{self.derived}{d}"] = grad.new_zeros(size, size, dtype=self.state_dtype)
        return state

    def _accumulate_factor(self, state, grad, d, beta2):
        """factor_d <- beta2 factor_d + (1 - beta2) (G Gᵀ or Gᵀ G), computed in fp32; returns the
        fp32 factor."""
        factor = ema_(state[f"factor{d}"].float(), gram(grad, d), beta2)
        state[f"factor{d}"].copy_(factor)
        return factor


class Shampoo(FactoredOptimizer):
    """Shampoo with Adam grafting: factors L = EMA(G Gᵀ), R = EMA(Gᵀ G) (bias-corrected), inverse
    roots L^(-1/4), R^(-1/4) refreshed every `precondition_frequency` steps f, momentum on the
    gradient, the preconditioned direction rescaled per block to the norm of Adam's direction, then
    decoupled weight decay. A 1-D block has one factor and exponent -1/2. The refreshes fall on
    steps 1, 1 + f, 1 + 2f, ..., so there is a root from the first step; Meta's Distributed Shampoo
    computes its roots on the multiples of f (f, 2f, ...) after its start_preconditioning_step: the
    same interval, another phase."""

    name, derived, second = "shampoo", "root", "graft"

    def __init__(self, params, lr, betas, weight_decay, eps, max_dim, precondition_frequency,
                 graft_beta2, graft_eps, state_dtype="fp32", cost="bytes"):
        super().__init__(params, lr, betas, weight_decay, eps, max_dim, precondition_frequency,
                         state_dtype, cost)
        self.graft_beta2, self.graft_eps = graft_beta2, graft_eps

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        t = self.step_count
        state = self._block_state(i, grad)
        for d in range(grad.ndim):
            factor = self._accumulate_factor(state, grad, d, beta2)
            if (t - 1) % self.frequency == 0:
                state[f"root{d}"].copy_(inverse_root(factor / (1 - beta2 ** t), 2 * grad.ndim,
                                                     self.eps))
        momentum = ema_(state["momentum"], grad, beta1)
        adam = adam_direction(momentum, ema_square_(state["graft"], grad, self.graft_beta2), t,
                              beta1, self.graft_beta2, self.graft_eps)
        filtered = momentum / (1 - beta1 ** t)
        roots = [state[f"root{d}"].float() for d in range(grad.ndim)]
        shampoo = roots[0] @ filtered @ roots[1] if grad.ndim == 2 else roots[0] @ filtered
        return shampoo * (adam.norm() / shampoo.norm().clamp_min(1e-30))


class SOAP(FactoredOptimizer):
    """SOAP: Adam run in the eigenbasis of Shampoo's factors, with decoupled weight decay. As in the
    published SOAP, a gradient enters the factors only after it has been used, so the basis never
    holds the gradient it rotates: a block's first step only builds its basis (an
    eigendecomposition, no update). After every `precondition_frequency` Adam steps the basis takes
    one power-iteration step and a QR decomposition from where it was, its directions (and the
    second moment's entries with them) ordered by their estimated eigenvalues: a slowly turning
    basis whose second moment still fits it. Momentum lives in the parameter's basis, the second
    moment in the rotated one."""

    name, derived, second = "soap", "basis", "second"

    def _new_state(self, grad):
        # adam_steps: a Python int (reading it never waits for a GPU); -1 while the block has no
        # basis. A block behind a zero-initialized weight (Q, K, V behind O, the MLP's input behind
        # its output) has an exactly zero first gradient; a basis built from a zero factor would be
        # arbitrary, and power iterations every few steps would take most of the run to repair it.
        return dict(super()._new_state(grad), adam_steps=-1)

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        state = self._block_state(i, grad)
        steps = state["adam_steps"]
        t = steps + 1 if steps >= 0 else 0  # this step's Adam step number (0: building the basis)
        if t == 0 and not grad.any():
            return None  # still no basis (a zero gradient leaves the zero factors as they are)
        update = self._adam_in_basis(state, grad, t, beta1, beta2) if t > 0 else None
        for d in range(grad.ndim):
            factor = self._accumulate_factor(state, grad, d, beta2)
            if t == 0:
                state[f"basis{d}"].copy_(symmetric_eigh(factor)[1])
            elif t % self.frequency == 0:
                self._turn_basis(state, factor, d)
        state["adam_steps"] = t
        return update

    def _turn_basis(self, state, factor, d):
        """basis_d <- QR(factor_d @ basis_d) with the directions sorted by estimated eigenvalue,
        largest first."""
        basis = state[f"basis{d}"].float()
        order = torch.argsort((basis * (factor @ basis)).sum(0), descending=True)  # diag(Bᵀ F B)
        state["second"].copy_(state["second"].index_select(d, order))
        state[f"basis{d}"].copy_(torch.linalg.qr(factor @ basis[:, order]).Q)

    def _adam_in_basis(self, state, grad, t, beta1, beta2):
        bases = [state[f"basis{d}"].float() for d in range(grad.ndim)]

        def rotate(x):
            return bases[0].T @ x @ bases[1] if x.ndim == 2 else bases[0].T @ x

        def unrotate(x):
            return bases[0] @ x @ bases[1].T if x.ndim == 2 else bases[0] @ x

        momentum = ema_(state["momentum"], grad, beta1)
        second = ema_square_(state["second"], rotate(grad), beta2)
        return unrotate(adam_direction(rotate(momentum), second, t, beta1, beta2, self.eps))


class AdamW(BlockOptimizer):
    """AdamW (bias-corrected, decoupled weight decay), the track's baseline; blocks are whole
    pieces."""

    name = "adamw"

    def __init__(self, params, lr, betas, weight_decay, eps):
        super().__init__(params, lr, betas, weight_decay, max_dim=2 ** 62, cost="poly")
        self.eps = eps

    def direction(self, i, grad):
        beta1, beta2 = self.param_groups[0]["betas"]
        t = self.step_count
        state = self._block_state(i, grad)
        return adam_direction(ema_(state["m"], grad, beta1), ema_square_(state["v"], grad, beta2),
                              t, beta1, beta2, self.eps)

    def _new_state(self, grad):
        return dict(m=torch.zeros_like(grad), v=torch.zeros_like(grad))


# --matrix_optimizer NAME -> (class, {constructor argument: Hyperparameters field}): a new track-3
# optimizer is its class, its fields in Hyperparameters and one entry here.
FACTOR_FLAGS = dict(max_dim="factor_max_dim", state_dtype="factor_dtype", cost="factor_block_cost")
OPTIMIZERS = {
    "shampoo": (Shampoo, dict(lr="shampoo_lr", betas="shampoo_betas", weight_decay="shampoo_wd",
                              eps="shampoo_eps",
                              precondition_frequency="shampoo_precondition_frequency",
                              graft_beta2="shampoo_graft_beta2", graft_eps="shampoo_graft_eps",
                              **FACTOR_FLAGS)),
    "soap": (SOAP, dict(lr="soap_lr", betas="soap_betas", weight_decay="soap_wd", eps="soap_eps",
                        precondition_frequency="soap_precondition_frequency", **FACTOR_FLAGS)),
    "adamw": (AdamW, dict(lr="adamw_lr", betas="adamw_betas", weight_decay="adamw_wd",
                          eps="adamw_eps")),
}


def check_hyperparameters(hp):
    """The track-3 fields' rules (train_gpt.check_hyperparameters applies them)."""
    for name, choices in CHOICES.items():
        if getattr(hp, name) not in choices:
            raise tg.ConfigError(f"--{name} must be one of {', '.join(choices)}, got "
                                 f"{getattr(hp, name)!r}")


def make_optimizer(name, params, hp):
    """The --matrix_optimizer `name` over `params` ((parameter, ParamSpec) pairs), from hp's
    flags."""
    cls, flags = OPTIMIZERS[name]
    return cls(params, **{argument: getattr(hp, flag) for argument, flag in flags.items()})
