"""FlexAttention's FLASH backend (train_gpt.py's --flex_backend flash): FlexWindowAttention's
mask and score mod rendered by Inductor as CuTe-DSL and run by flash-attn-4's SM90 kernels,
forward and backward, instead of FlexAttention's Triton kernels.

It needs the flash-attn-4 package (PyPI pre-releases: `pip install --pre flash-attn-4`), not in
the GPU image; docs/gpu-smoke.md says how to carry it. tools/cuda_compile_check.py compiles these
kernels for sm_90 on a machine without a GPU when the package is there. train_gpt.py loads this file
only on that flag, and the run's log carries it after the script."""
import importlib.util

import torch
from torch.nn.attention.flex_attention import BlockMask

from train_gpt import ATTN_BLOCK, ConfigError, FlexWindowAttention, sliding_document_mask

FLASH_OPTIONS = {"BACKEND": "FLASH"}


def flash_available():
    """Whether flash-attn-4's CuTe-DSL interface imports (what Inductor asks before FLASH)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn at all
        return False


def flash_document_mask(docs, window_tokens):
    """sliding_document_mask's blocks, with a mask mod that reads the window as FLASH can: at the
    batch index (always 0) of a (1,) buffer of fixed layout. torch 2.11 renders a 0-dim buffer's
    load as an index by the constant 0, which the CuTe DSL refuses ("Expected TensorSSA, but got
    <class 'int'>"), and its FLASH lowering does not realize a captured buffer computed in the
    graph ("convert FlexibleLayout to FixedLayout first"); as_strided fixes the layout."""
    blocks = sliding_document_mask(docs, window_tokens)
    window = torch.as_strided(torch.as_tensor(window_tokens).reshape(1), (1,), (1,))
    seq_len = docs.numel()
    padded = torch.cat([docs, (docs[-1:] + 1).expand(-(-seq_len // ATTN_BLOCK) * ATTN_BLOCK
                                                      - seq_len)])

    def mask_mod(b, h, q_idx, kv_idx):  # sliding_document_mask's, the window read at [b]
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window[b]) \
            & (padded[q_idx] == padded[kv_idx])

    return BlockMask.from_kv_blocks(blocks.kv_num_blocks, blocks.kv_indices,
                                    blocks.full_kv_num_blocks, blocks.full_kv_indices,
                                    BLOCK_SIZE=ATTN_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


class FlashWindowAttention(FlexWindowAttention):
    """FlexWindowAttention on flash-attn-4's kernels: the scale and the window read at the batch
    index of (1,) buffers (flash_document_mask says why)."""

    mask = staticmethod(flash_document_mask)

    def __call__(self, q, k, v, mask, scale):
        scale = scale.float().view(1)
        out = self.flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=mask,
                        scale=1.0, score_mod=lambda score, b, h, q_idx, kv_idx: score * scale[b],
                        kernel_options=FLASH_OPTIONS)
        return out[0].transpose(0, 1)


def flash_window_attention(hp):
    """The attention of --flex_backend flash, or a one-line error when flash-attn-4 is missing."""
    if not flash_available():
        raise ConfigError("--flex_backend flash needs flash-attn-4 (flash_attn.cute does not "
                          "import): pip install --pre flash-attn-4 (docs/gpu-smoke.md), or use "
                          "--flex_backend triton")
    return FlashWindowAttention(compile_kernel=not hp.compile)
