"""Qwen2.5-VL's image encoder: a ViT over the image's own patch grid (any size and aspect
ratio, as the checkpoint's Qwen2VLImageProcessor resized it to multiples of patch * merge).

Each patch (C x temporal_patch_size x P x P pixels) is embedded by a Conv3d, then pre-norm
blocks run with a 2-D rotary position (the patch's row and column). Most blocks attend only
within windows of window_size pixels; the fullatt_block_indexes blocks attend over the whole
image; attention never crosses images. The merger folds each spatial_merge_size^2 group of
patches into one token of the language model's width. The processor already orders patches
group by group, so a group's patches are consecutive; the blocks see the groups reordered
window by window (so a window is one contiguous run) and the output is put back in the
image's row-major group order: image i gives t * h * w / merge^2 tokens."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zllm.executor.models.vision.checkpoint import (
    copy_tensors,
    decoded_images,
    image_processor,
    tensor_index,
)

# transformers fixes every RMSNorm of the vision tower (the blocks' and the merger's) at 1e-6.
_RMS_EPS = 1e-6
# Where the encoder's tensors live: transformers (4 and 5, which maps its `model.visual.`
# back on save) writes `visual.`; a checkpoint saved from the inner module keeps `model.`.
_PREFIXES = ("visual.", "model.visual.")
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """The vision_config fields the encoder reads (defaults: transformers 5's
    Qwen2_5_VLVisionConfig)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, vision: dict) -> QwenVisionConfig:
        d = cls()
        rope = vision.get("rope_parameters") or {}
        config = cls(
            depth=vision.get("depth", d.depth),
            hidden_size=vision.get("hidden_size", d.hidden_size),
            intermediate_size=vision.get("intermediate_size", d.intermediate_size),
            num_heads=vision.get("num_heads", d.num_heads),
            # Qwen's Hub configs (written by transformers 4) spell it in_chans.
            in_channels=vision.get("in_channels", vision.get("in_chans", d.in_channels)),
            patch_size=vision.get("patch_size", d.patch_size),
            temporal_patch_size=vision.get("temporal_patch_size", d.temporal_patch_size),
            spatial_merge_size=vision.get("spatial_merge_size", d.spatial_merge_size),
            window_size=vision.get("window_size", d.window_size),
            fullatt_block_indexes=tuple(
                vision.get("fullatt_block_indexes", d.fullatt_block_indexes)
            ),
            out_hidden_size=vision.get("out_hidden_size", d.out_hidden_size),
            hidden_act=vision.get("hidden_act", d.hidden_act),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", d.rope_theta))),
        )
        config.check()
        return config

    def check(self) -> None:
        """Refuse a vision_config this encoder cannot run, naming the field."""
        for name in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"vision_config.{name} {getattr(self, name)!r}: not one integer")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision_config.hidden_size {self.hidden_size} over num_heads "
                f"{self.num_heads} is not a head width divisible by 4 (2-D rotary)"
            )
        if self.window_units < 1:
            raise ValueError(
                f"vision_config.window_size {self.window_size} is under one merged patch "
                f"({self.patch_size * self.spatial_merge_size} pixels)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches folded into one output token."""
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """A window's side in merged patches."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a batch's patches go: `order[j]` is the merged group the blocks see j-th
    (groups sorted window by window), `positions` each patch's (row, col) in that order,
    and the attention segments as runs of (length, count) equal consecutive segments."""

    order: torch.Tensor
    positions: torch.Tensor
    image_runs: list[tuple[int, int]]
    window_runs: list[tuple[int, int]]


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive equal segment lengths grouped, so each run is one batched SDPA call."""
    return [(length, len(list(group))) for length, group in itertools.groupby(lengths)]


def _image_layout(
    t: int, h: int, w: int, config: QwenVisionConfig
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One image's (window order of its groups, its patches' positions in that order, its
    windows' lengths in patches)."""
    m, side = config.spatial_merge_size, config.window_units
    rows, cols = h // m, w // m
    group = torch.arange(t * rows * cols)
    frame, row, col = group // (rows * cols), (group // cols) % rows, group % cols
    windows_down, windows_across = -(-rows // side), -(-cols // side)
    window = (frame * windows_down + row // side) * windows_across + col // side
    # A stable sort keeps the groups of a window in row-major order.
    order = torch.sort(window, stable=True).indices
    sizes = torch.bincount(window, minlength=t * windows_down * windows_across)
    inner = torch.arange(config.merge_unit)
    patch_row = (row[order, None] * m + inner // m).flatten()
    patch_col = (col[order, None] * m + inner % m).flatten()
    lengths = (sizes[sizes > 0] * config.merge_unit).tolist()
    return order, torch.stack([patch_row, patch_col], dim=-1), lengths


def _layout(grid_thw: list[list[int]], config: QwenVisionConfig) -> _Layout:
    orders, positions, image_lengths, window_lengths = [], [], [], []
    groups_before = 0
    for t, h, w in grid_thw:
        if h % config.spatial_merge_size or w % config.spatial_merge_size:
            raise ValueError(
                f"image grid {h}x{w} patches is not a multiple of spatial_merge_size "
                f"{config.spatial_merge_size}"
            )
        order, image_positions, lengths = _image_layout(t, h, w, config)
        orders.append(order + groups_before)
        positions.append(image_positions)
        window_lengths += lengths
        image_lengths += [h * w] * t  # each frame attends over itself (transformers' cu_seqlens)
        groups_before += t * h * w // config.merge_unit
    return _Layout(
        order=torch.cat(orders),
        positions=torch.cat(positions),
        image_runs=_runs(image_lengths),
        window_runs=_runs(window_lengths),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + _RMS_EPS)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the whole head (halves rotated), in fp32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, config: QwenVisionConfig) -> None:
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.norm1 = nn.Parameter(torch.ones(width))
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.Parameter(torch.ones(width))
        self.gate_proj = nn.Linear(width, inner)
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, width)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        x = x + self._attend(_rms_norm(x, self.norm1), cos, sin, runs)
        h = _rms_norm(x, self.norm2)
        return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))

    def _attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Bidirectional attention within each segment; a run of equal-length segments is
        one SDPA call over a batch of them."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for length, count in runs:
            end = start + length * count
            q_run, k_run, v_run = (
                t[start:end].view(count, length, self.heads, -1).transpose(1, 2) for t in (q, k, v)
            )
            attended = F.scaled_dot_product_attention(q_run, k_run, v_run)
            out[start:end] = attended.transpose(1, 2).reshape(end - start, self.heads, -1)
            start = end
        return self.proj(out.view(n, -1))


class Qwen25VLImageEncoder(nn.Module):
    """pixel_values [patches, C*T*P*P] + grid_thw [images, 3] -> [image tokens, out_hidden_size].

    The weights' dtype (and so the output's) is `encoder.dtype`."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = QwenVisionConfig.from_dict(config.get("vision_config") or {})
        c = self.config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Conv3d(
            c.in_channels, c.hidden_size, kernel, stride=kernel, bias=False
        )
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.depth))
        self.merger_norm = nn.Parameter(torch.ones(c.hidden_size))
        folded = c.hidden_size * c.merge_unit
        self.merger_fc1 = nn.Linear(folded, folded)
        self.merger_fc2 = nn.Linear(folded, c.out_hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c = self.config
        grid = [[int(v) for v in row] for row in grid_thw.tolist()]
        patches = sum(t * h * w for t, h, w in grid)
        patch_width = c.in_channels * c.temporal_patch_size * c.patch_size**2
        if tuple(pixel_values.shape) != (patches, patch_width):
            raise ValueError(
                f"pixel_values has shape {list(pixel_values.shape)}; grid_thw {grid} "
                f"makes it [{patches}, {patch_width}]"
            )
        device = self.patch_embed.weight.device
        if not grid:
            return torch.empty(0, c.out_hidden_size, device=device, dtype=self.dtype)
        layout = _layout(grid, c)
        order = layout.order.to(device)
        pixels = pixel_values.to(device, self.dtype)
        x = self.patch_embed(
            pixels.reshape(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        ).view(patches, c.hidden_size)
        x = x.view(-1, c.merge_unit, c.hidden_size)[order].view(patches, c.hidden_size)
        cos, sin = self._rotary(layout.positions.to(device))
        for index, block in enumerate(self.blocks):
            full = index in c.fullatt_block_indexes
            x = block(x, cos, sin, layout.image_runs if full else layout.window_runs)
        folded = _rms_norm(x, self.merger_norm).view(-1, c.hidden_size * c.merge_unit)
        merged = self.merger_fc2(F.gelu(self.merger_fc1(folded)))
        out = torch.empty_like(merged)
        out[order] = merged  # back to each image's row-major group order
        return out

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, 1, head_dim]: the row's angles then the column's, twice."""
        # Computed here in fp32 (not a buffer a .to(bfloat16) would round).
        half = self.config.head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half
        inv_freq = 1.0 / self.config.rope_theta**exponents
        angles = (positions[..., None].float() * inv_freq).flatten(1)
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Each checkpoint name (transformers' Qwen2_5_VisionTransformerPretrainedModel's,
        under `prefix`) -> the tensor it fills."""
        targets = {
            f"{prefix}patch_embed.proj.weight": self.patch_embed.weight,
            f"{prefix}merger.ln_q.weight": self.merger_norm,
            f"{prefix}merger.mlp.0.weight": self.merger_fc1.weight,
            f"{prefix}merger.mlp.0.bias": self.merger_fc1.bias,
            f"{prefix}merger.mlp.2.weight": self.merger_fc2.weight,
            f"{prefix}merger.mlp.2.bias": self.merger_fc2.bias,
        }
        for i, block in enumerate(self.blocks):
            p = f"{prefix}blocks.{i}."
            targets[f"{p}norm1.weight"] = block.norm1
            targets[f"{p}norm2.weight"] = block.norm2
            linears = {
                "attn.qkv": block.qkv, "attn.proj": block.proj, "mlp.gate_proj": block.gate_proj,
                "mlp.up_proj": block.up_proj, "mlp.down_proj": block.down_proj,
            }  # fmt: skip
            for name, linear in linears.items():
                targets[f"{p}{name}.weight"] = linear.weight
                targets[f"{p}{name}.bias"] = linear.bias
        return targets

    def load_checkpoint(self, model_dir: str) -> None:
        """Fill every tensor from the checkpoint's safetensors (ValueError naming a missing
        or mis-shaped one)."""
        names = tensor_index(model_dir)
        prefix = next((p for p in _PREFIXES if f"{p}merger.ln_q.weight" in names), None)
        if prefix is None:
            raise ValueError(f"{model_dir}: no Qwen2.5-VL vision tensors (visual.merger.ln_q)")
        targets = self.checkpoint_targets(prefix)
        copy_tensors(model_dir, names, targets)


def pixel_values(images: list[bytes], processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C*T*P*P], image_grid_thw [images, 3]) of the encoded images,
    decoded to RGB and prepared by the checkpoint's image processor."""
    batch = processor(images=decoded_images(images), return_tensors="pt")
    return batch["pixel_values"], batch["image_grid_thw"]


class Qwen25VLImages:
    """Qwen2.5-VL's encoder with its processor, as features.py's ImageEncoder: one batch's
    tokens cut back into each image's (t x h x w / merge^2 of them)."""

    def __init__(
        self, model_path: str, config: dict, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.encoder = Qwen25VLImageEncoder(config).to(dtype)
        self.encoder.load_checkpoint(model_path)
        self.encoder.to(device).eval()
        self.processor = image_processor(model_path)

    @classmethod
    def load(
        cls,
        model_path: str,
        config: dict,
        dtype: torch.dtype,
        language_model: nn.Module,
        device: torch.device | str = "cpu",
    ) -> Qwen25VLImages:
        """The family's encoder (ImageRules.encoder), loaded: its own weights onto `device`."""
        return cls(model_path, config, dtype, device)

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pixels, grid_thw = pixel_values(images, self.processor)
        tokens = self.encoder(pixels.to(self.encoder.dtype), grid_thw)
        merge = self.encoder.config.spatial_merge_size**2
        counts = [int(t * h * w) // merge for t, h, w in grid_thw.tolist()]
        return [part.clone() for part in tokens.split(counts)]
