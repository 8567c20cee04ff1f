"""Weight-only quantization through torch's own kernels: int8 (one scale per output channel,
``aten._weight_int8pack_mm``) and int4 (groups of 32 with scale and zero point, ``aten._weight_int4pack_mm``
and its CPU twin). Activations stay in a float dtype; only the bytes read per token shrink, which is the
lesson: decode reads every weight once per token, so halving the bytes nearly doubles decode.

Why not torchao: its int8 weight-only path (0.18, ``Int8WeightOnlyConfig``) ran one layer in 331 us on this
2-core CPU against 37 us for torch's packed kernel and 61 us for plain bf16 (it dequantizes); torch's ops are
what torchao itself used to call. Layers that are not ``nn.Linear``, or whose width the int4 kernel cannot
take, stay in float and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model.hardware import gemm_dtype

FORMATS = ("int8", "int4")
INT4_GROUP = 32
INT4_INNER_K_TILES = 2


PREFILL_ROWS = 16      # from this many rows an int8 product widens its codes and calls the float GEMM (see below)


def _many(rows: int | torch.SymInt) -> bool:
    """Whether a product of ``rows`` rows goes through the float GEMM: from ``PREFILL_ROWS``, and always in the
    prefill package, whose number of rows is symbolic (any prompt) and whose widened weights freezing computes
    once, at its build."""
    return isinstance(rows, torch.SymInt) or rows >= PREFILL_ROWS


class Int8Linear(nn.Module):
    """``y = x @ (q * s).T + b`` with ``q`` int8 ``[out, in]`` and ``s`` per output channel.

    torch's int8 kernel is made for a few rows: a prefill's many rows go through the float GEMM instead (oneDNN's,
    AMX tiles in bfloat16), over the codes widened to the activations' float for that call (every code, -127 to
    127, is exact in bfloat16), and the scales applied to its output: the same product, computed by the kernel
    made for its shape. SmolLM2's linear layers, bfloat16 activations, 2-vCPU Sapphire Rapids: 32 rows 65.5 ->
    39.6 ms, 128 rows 198 -> 56, 512 rows 715 -> 89; at 8 rows the int8 kernel wins (26.6 against 34.1)."""

    def __init__(self, linear: nn.Linear, act_dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(act_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(act_dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if _many(rows.shape[0]):
            wide = gemm_dtype(rows.dtype, rows.device.type)
            y = (torch.nn.functional.linear(rows.to(wide), self.weight_int8.to(wide)) * self.scales).to(rows.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Groups of ``INT4_GROUP`` input channels, each with a scale and a zero point: ``w = (q - 8) * s + z``."""

    def __init__(self, linear: nn.Linear, act_dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        groups = w.view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=1e-12) / 15.0
        q = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
        self.cpu = w.device.type == "cpu"
        if self.cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                INT4_INNER_K_TILES)
        zeros = low + 8 * scale                                      # the kernels subtract 8 from every code
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale.squeeze(-1).t(), zeros.squeeze(-1).t()], dim=-1).to(act_dtype)
                             .contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(act_dtype))
        self.in_features, self.out_features = in_f, out_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight_int4, INT4_GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


@dataclass(frozen=True)
class Quantized:
    fmt: str
    layers: int                  # linear layers now in ``fmt``
    kept: int                    # linear layers left in float (not nn.Linear, or a width the kernel refuses)

    def describe(self, act_dtype: str) -> str:
        kept = f", {self.kept} kept in {act_dtype}" if self.kept else ""
        return f"{self.fmt} weights ({self.layers} linear layers{kept}), {act_dtype} activations"


def quantize(model: nn.Module, fmt: str, act_dtype: torch.dtype) -> Quantized:
    """Replace the model's linear layers (the output projection too) with ``fmt`` ones, in place."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: use one of {', '.join(FORMATS)}")
    make = Int8Linear if fmt == "int8" else Int4Linear
    done = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if fmt == "int4" and (child.in_features % (INT4_GROUP * INT4_INNER_K_TILES) or child.out_features % 16):
                kept += 1
                continue
            setattr(parent, name, make(child, act_dtype))
            done += 1
    return Quantized(fmt, done, kept)


def parameter_count(model: nn.Module) -> int:
    """Parameters as the model was trained with them: a quantized layer still holds in x out weights."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            count += module.in_features * module.out_features + (module.bias.numel() if module.bias is not None else 0)
    return int(count)


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every parameter and buffer, except the input embedding table, of which a
    lookup reads one row (unless the output projection reads it all, as tied embeddings do)."""
    total = sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and getattr(output, "weight", None) is embedding
    return int(total - (0 if tied else embedding.nbytes))


def supported(fmt: str, device: torch.device) -> str | None:
    """Why ``fmt`` cannot run on ``device`` here, or None if it can (probed with a tiny layer)."""
    try:
        layer = nn.Linear(INT4_GROUP * INT4_INNER_K_TILES, 32, bias=False).to(device)
        act = torch.bfloat16 if device.type != "cpu" else torch.float32
        module = (Int8Linear if fmt == "int8" else Int4Linear)(layer, act)
        module(torch.zeros(1, layer.in_features, device=device, dtype=act))
        return None
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{fmt} weights need torch's {fmt} weight-only kernel, which this torch has not for {device.type} " \
               f"({first[:120]})"
