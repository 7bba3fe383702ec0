"""Patch-parallel VAE decode and encode: each rank runs diffusers' VAE on one horizontal band, the ``forward`` of each
module that sees several rows swapped for the call (halo rows, combined norm statistics, gathered keys)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paradit.parallel.comm import all_gather_uneven, split_sizes

if TYPE_CHECKING:
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

# Low-precision group norms take statistics in float32 chunks of this many elements, keeping the copy small.
_STATS_CHUNK = 1 << 26


@dataclass(frozen=True)
class _Bands:
    rows: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None
    peers: tuple[int, ...]

    def scaled(self, local_rows: int) -> tuple[int, ...]:
        """Rows per rank of a tensor ``f`` times the latent's height, ``local_rows`` high on this rank."""
        factor, rest = divmod(local_rows, self.rows[self.rank])
        if rest or not factor:
            raise RuntimeError(
                f"a band of {local_rows} rows is no whole multiple of this rank's {self.rows[self.rank]} latent "
                "rows (an image size that is no multiple of the VAE's downsampling?)"
            )
        return tuple(r * factor for r in self.rows)


# _exchange_halos, _gather_moments, _gather_rows: the only places ranks talk (tests swap them to prove checks bite).
@torch.compiler.disable
def _exchange_halos(x: torch.Tensor, bands: _Bands, plan: _ConvPlan) -> Callable[[], tuple[torch.Tensor | None, ...]]:
    """Posts the exchange of ``x``'s halo rows; ``finish()`` waits and gives (above, below), None where none come."""
    r, n = bands.rank, x.shape[-2]
    ops, halos = [], []
    up = (r - 1, plan.send_up[r], plan.recv_up[r], 0)
    down = (r + 1, plan.send_down[r], plan.recv_down[r], n - plan.send_down[r])
    for peer, send, recv, first in (up, down):
        if send:
            ops.append(dist.P2POp(dist.isend, x.narrow(-2, first, send).contiguous(), bands.peers[peer], bands.group))
        halos.append(x.new_empty(*x.shape[:-2], recv, x.shape[-1]) if recv else None)
        if recv:
            ops.append(dist.P2POp(dist.irecv, halos[-1], bands.peers[peer], bands.group))
    works = dist.batch_isend_irecv(ops) if ops else []

    def finish() -> tuple[torch.Tensor | None, ...]:
        # ``ops`` holds the send buffers until here, so they outlive the transfers.
        for work in works:
            work.wait()
        ops.clear()
        return tuple(halos)

    return finish


@torch.compiler.disable
def _gather_moments(moments: torch.Tensor, bands: _Bands) -> torch.Tensor:
    """(world, 3, B, C) from this rank's (3, B, C)."""
    return _gather_rows(moments.unsqueeze(0), 0, (1,) * len(bands.rows), bands)


@torch.compiler.disable
def _gather_rows(x: torch.Tensor, dim: int, sizes: tuple[int, ...], bands: _Bands) -> torch.Tensor:
    return x if len(bands.rows) == 1 else all_gather_uneven(x, dim, list(sizes), bands.group)


@dataclass(frozen=True)
class _ConvPlan:
    """For every rank: the input rows its output band reads (``need``: [lo, hi), may reach past the image where the
    convolution zero-pads), and the halo row counts it sends to / receives from the rank above and below."""

    height: int
    bands: tuple[tuple[int, int], ...]
    need: tuple[tuple[int, int], ...]
    send_up: tuple[int, ...]
    recv_up: tuple[int, ...]
    send_down: tuple[int, ...]
    recv_down: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def _conv_plan(rows: tuple[int, ...], kernel: int, stride: int, pad_top: int, pad_bottom: int) -> _ConvPlan:
    # Every rank computes the whole plan, so a band too thin for a halo raises on all ranks alike (no hang).
    height = sum(rows)
    out_height = (height + pad_top + pad_bottom - kernel) // stride + 1
    # Output bands are the latent bands at the output's scale: the rows the one-process output has there.
    if any(size * out_height % height for size in rows):
        raise ValueError(f"a convolution maps {height} rows to {out_height}: bands {rows} do not map to whole rows")
    starts = list(itertools.accumulate(rows, initial=0))
    bands = tuple(zip(starts, starts[1:]))
    outs = [(a * out_height // height, b * out_height // height) for a, b in bands]
    need = tuple((c * stride - pad_top, (d - 1) * stride - pad_top + kernel) for c, d in outs)
    world = len(rows)
    recv_up = [max(0, a - max(lo, 0)) for (a, _), (lo, _) in zip(bands, need)]
    recv_down = [max(0, min(hi, height) - b) for (_, b), (_, hi) in zip(bands, need)]
    for r in range(world):
        if (r and recv_up[r] > rows[r - 1]) or (r < world - 1 and recv_down[r] > rows[r + 1]):
            raise ValueError(f"bands {rows} are too thin for a {kernel}-row convolution's halo")
    send_up = [0] + recv_down[:-1]
    send_down = recv_up[1:] + [0]
    return _ConvPlan(height, bands, need, tuple(send_up), tuple(recv_up), tuple(send_down), tuple(recv_down))


def _conv_forward(
    module: nn.Module, bands: _Bands, pad_h: tuple[int, int], pad_w: tuple[int, int], temporal_pad: int
) -> Callable:
    weight = module.weight
    three_d = weight.ndim == 5
    conv = F.conv3d if three_d else F.conv2d
    kernel, stride = weight.shape[-2], module.stride[-2]
    if any(d != 1 for d in module.dilation) or module.padding_mode != "zeros":
        raise NotImplementedError(f"{type(module).__name__}: only undilated, zero-padded convolutions are banded")

    def run(x: torch.Tensor, rows_pad: int) -> torch.Tensor:
        left, right = pad_w
        if left != right:
            x = F.pad(x, (left, right))
            left = 0
        padding = (0, rows_pad, left) if three_d else (rows_pad, left)
        return conv(x, weight, module.bias, module.stride, padding, 1, module.groups)

    def zeros(x: torch.Tensor, rows: int) -> torch.Tensor | None:
        """Where the band's input reaches past the image: the convolution's zero padding."""
        return x.new_zeros(*x.shape[:-2], rows, x.shape[-1]) if rows > 0 else None

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if three_d:
            # Wan's causal time axis, as the module itself does it: cached frames first, then zeros for the rest.
            front = temporal_pad
            if cache_x is not None and front > 0:
                x = torch.cat([cache_x.to(x.device), x], dim=2)
                front -= cache_x.shape[2]
            if front > 0:
                x = F.pad(x, (0, 0, 0, 0, front, 0))
        top, bottom = pad_h
        if kernel == 1 and top == bottom == 0 and stride == 1:
            return run(x, 0)
        plan = _conv_plan(bands.scaled(x.shape[-2]), kernel, stride, top, bottom)
        halos = _exchange_halos(x, bands, plan)
        n = x.shape[-2]
        (a, b), (lo, hi) = plan.bands[bands.rank], plan.need[bands.rank]
        if stride == 1 and top == bottom and lo == a - top and hi == b + top and n >= 2 * top:
            # Same-size: the band as it is (no copy) while the halos travel, then each inner edge's rows redone.
            out = run(x, top)
            above, below = halos()
            if above is not None:
                out[..., :top, :] = run(torch.cat([above, x[..., : 2 * top, :]], dim=-2), 0)
            if below is not None:
                out[..., n - top :, :] = run(torch.cat([x[..., n - 2 * top :, :], below], dim=-2), 0)
            return out
        above, below = halos()
        middle = x[..., max(lo - a, 0) : n - max(b - hi, 0), :]
        pieces = [p for p in (zeros(x, -lo), above, middle, below, zeros(x, hi - max(plan.height, b))) if p is not None]
        return run(torch.cat(pieces, dim=-2) if len(pieces) > 1 else pieces[0], 0)

    return forward


def _group_norm_forward(module: nn.GroupNorm, bands: _Bands) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        batch, channels = x.shape[:2]
        dims = tuple(range(2, x.ndim))
        count = x[0, 0].numel()
        # Per-channel var_mean (Welford): any layout, no copy in float32; lower precisions upcast by channel chunks.
        # The ranks' count, mean and M2 then combine in float64 (Chan's method).
        if x.dtype in (torch.float32, torch.float64):
            var, mean = torch.var_mean(x, dim=dims, correction=0)
        else:
            step = max(1, _STATS_CHUNK // max(1, batch * count))
            pieces = [torch.var_mean(chunk.float(), dim=dims, correction=0) for chunk in x.split(step, dim=1)]
            var, mean = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1)
        mean = mean.double()
        moments = torch.stack([torch.full_like(mean, count), mean, var.double() * count])
        every = _gather_moments(moments, bands)  # (world, 3, B, C)
        groups = module.num_groups
        every = every.view(-1, 3, batch, groups, channels // groups)
        n, m, m2 = every[:, 0], every[:, 1], every[:, 2]
        total = n.sum(dim=(0, 3))
        group_mean = (n * m).sum(dim=(0, 3)) / total
        spread = m - group_mean[None, :, :, None]
        group_var = (m2 + n * spread * spread).sum(dim=(0, 3)) / total
        rstd = torch.rsqrt(group_var + module.eps).repeat_interleave(channels // groups, dim=1)
        mean_c = group_mean.repeat_interleave(channels // groups, dim=1)
        scale = rstd if module.weight is None else rstd * module.weight.double()
        shift = -mean_c * scale if module.bias is None else module.bias.double() - mean_c * scale
        shape = (batch, channels) + (1,) * (x.ndim - 2)
        # As the native kernel: y = x * scale + shift in float32, rounded once to the input's dtype.
        out = torch.empty_like(x)
        torch.addcmul(shift.float().view(shape), x, scale.float().view(shape), out=out)
        return out

    return forward


def _attention_forward(attn: nn.Module, bands: _Bands) -> Callable:
    """``UNetMidBlock2D``'s ``Attention`` (AttnProcessor2_0's math) with keys and values over the whole image."""

    def forward(hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if hidden_states.ndim != 4 or encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("banded attention covers image self-attention without a mask")
        if attn.spatial_norm is not None or attn.norm_q is not None or attn.norm_k is not None:
            raise NotImplementedError("banded attention covers the VAE mid-block's attention only")
        residual = hidden_states
        batch, channels, height, width = hidden_states.shape
        x = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        if attn.group_norm is not None:
            x = attn.group_norm(x.transpose(1, 2)).transpose(1, 2)
        whole = _gather_rows(x, 1, tuple(r * width for r in bands.scaled(height)), bands)
        query, key, value = attn.to_q(x), attn.to_k(whole), attn.to_v(whole)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        out = out.transpose(-1, -2).reshape(batch, channels, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor

    return forward


def _causal_attention_forward(block: nn.Module, bands: _Bands) -> Callable:
    """Wan / Qwen-Image's single-head attention over each frame, with keys and values over the whole frame."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        identity = x
        batch, channels, time, height, width = x.shape
        x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, height, width)
        x = block.norm(x)
        whole = _gather_rows(x, 2, bands.scaled(height), bands)
        weight, bias = block.to_qkv.weight, block.to_qkv.bias
        query = F.conv2d(x, weight[:channels], None if bias is None else bias[:channels])
        key_value = F.conv2d(whole, weight[channels:], None if bias is None else bias[channels:])
        query = query.reshape(batch * time, 1, channels, -1).permute(0, 1, 3, 2)
        key_value = key_value.reshape(batch * time, 1, 2 * channels, -1).permute(0, 1, 3, 2)
        key, value = key_value.chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(query.contiguous(), key.contiguous(), value.contiguous())
        out = out.squeeze(1).permute(0, 2, 1).reshape(batch * time, channels, height, width)
        out = block.proj(out)
        return out.view(batch, time, channels, height, width).permute(0, 2, 1, 3, 4) + identity

    return forward


def _over_one_frame(banded: Callable, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """The module's own forward, banded: it takes a feature cache argument and, having no time axis, refuses one."""
    if cache_x is not None:
        raise ValueError("a causal convolution over one frame takes no feature cache")
    return banded(x.squeeze(2)).unsqueeze(2)


def _downsample_forward(block: nn.Module) -> Callable:
    """``Downsample2D`` with ``padding=0``: its bottom pad belongs to the image, not the band, so it moves into the
    banded convolution (as does the bottom of Wan's ``ZeroPad2d``: only the last band pads)."""

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return block.conv(F.pad(hidden_states, (0, 1, 0, 0)))

    return forward


def _replacements(vae: nn.Module, bands: _Bands) -> list[tuple[nn.Module, Callable]]:
    """Raises, before any swap, on a module not bandable."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.downsampling import Downsample2D

    swaps: list[tuple[nn.Module, Callable]] = []
    conv_pads: dict[nn.Module, tuple[int, int]] = {}  # (top, bottom) rows padded in front
    for module in vae.modules():  # parents before children: a pad is seen before the convolution it feeds
        if isinstance(module, Downsample2D) and module.use_conv and module.padding == 0:
            if module.norm is not None:
                raise NotImplementedError("Downsample2D with a norm")
            conv_pads[module.conv] = (0, 1)
            swaps.append((module, _downsample_forward(module)))
        elif isinstance(module, nn.Sequential):
            children = list(module)
            for first, second in zip(children, children[1:]):
                if isinstance(first, nn.ZeroPad2d) and isinstance(second, nn.Conv2d):
                    conv_pads[second] = tuple(first.padding[2:])
                    swaps.append((first, functools.partial(F.pad, pad=(*first.padding[:2], 0, 0))))
        elif isinstance(module, nn.ZeroPad2d) and not any(module is moved for moved, _ in swaps):
            raise NotImplementedError("a ZeroPad2d that does not feed a convolution")
        elif isinstance(module, nn.Conv2d) and len(getattr(module, "_padding", ())) == 4:
            # Qwen-Image 2.1's causal conv, a Conv2d over (batch, channels, 1 frame, H, W) padded (w, w, h, h).
            banded = _conv_forward(module, bands, module._padding[2:4], module._padding[0:2], 0)
            swaps.append((module, functools.partial(_over_one_frame, banded)))
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
            if hasattr(module, "_padding"):  # Wan / Qwen-Image causal conv: (w, w, h, h, 2 t, 0)
                pad_w, pad_h, temporal = module._padding[0:2], module._padding[2:4], module._padding[4]
            else:
                if isinstance(module.padding, str) or (module.weight.ndim == 5 and module.padding[0]):
                    raise NotImplementedError(f"{type(module).__name__} with padding={module.padding!r}")
                pad_w, pad_h, temporal = (module.padding[-1],) * 2, (module.padding[-2],) * 2, 0
                if module in conv_pads:
                    # The pad in front keeps doing the width (never split); its rows move into the convolution.
                    top, bottom = conv_pads[module]
                    pad_h = (pad_h[0] + top, pad_h[1] + bottom)
            swaps.append((module, _conv_forward(module, bands, pad_h, pad_w, temporal)))
        elif isinstance(module, nn.GroupNorm):
            swaps.append((module, _group_norm_forward(module, bands)))
        elif isinstance(module, Attention):
            swaps.append((module, _attention_forward(module, bands)))
        elif type(module).__name__.endswith("AttentionBlock") and hasattr(module, "to_qkv"):
            swaps.append((module, _causal_attention_forward(module, bands)))
        elif isinstance(module, (nn.ConvTranspose2d, nn.ConvTranspose3d)):
            raise NotImplementedError(f"{type(module).__name__} is not banded")
    return swaps


def _run_banded(vae: nn.Module, x: torch.Tensor, factor: int, group: dist.ProcessGroup | None, run: Callable):
    """``run`` on this rank's band of ``x`` (``factor`` rows per latent row); every rank gets the bands gathered."""
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        peers = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(world))
    else:
        world, rank, peers, group = 1, 0, (0,), None
    height = x.shape[-2] // factor
    if height < world:
        raise ValueError(f"a latent of {height} rows cannot give each of {world} ranks a row")
    rows = split_sizes(height, world)
    bands = _Bands(tuple(rows), rank, group, peers)
    swaps = _replacements(vae, bands)
    # An instance may carry its own forward already (accelerate's offload hooks do): that one comes back.
    previous = [module.__dict__.get("forward") for module, _ in swaps]
    tiling = getattr(vae, "use_tiling", None)  # off: tiles are a different computation
    try:
        if tiling:
            vae.use_tiling = False
        for module, forward in swaps:
            module.forward = forward
        band = run(x.narrow(-2, sum(rows[:rank]) * factor, rows[rank] * factor))
        return _gather_rows(band, band.ndim - 2, bands.scaled(band.shape[-2]), bands)
    finally:
        for (module, _), forward in zip(swaps, previous):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
        if tiling:
            vae.use_tiling = tiling


@torch.no_grad()
def parallel_decode(vae: nn.Module, latents: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``vae.decode(latents).sample`` on every rank of ``group`` (None: the default group)."""
    return _run_banded(vae, latents, 1, group, lambda band: vae.decode(band).sample)


@torch.no_grad()
def parallel_encode(
    vae: nn.Module, images: torch.Tensor, group: dist.ProcessGroup | None = None
) -> DiagonalGaussianDistribution:
    """``vae.encode(images).latent_dist``. The height must be a multiple of the VAE's factor (8; 16 for Wan 2.2) so
    bands stay aligned to every stride-2 step."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    # Image rows per latent row (Wan 2.2's patchify included).
    factor = getattr(vae, "spatial_compression_ratio", None) or 2 ** (len(vae.config.block_out_channels) - 1)
    if images.shape[-2] % factor:
        raise ValueError(f"image height {images.shape[-2]} is not a multiple of the VAE's factor {factor}")
    whole = _run_banded(vae, images, factor, group, lambda band: vae.encode(band).latent_dist.parameters)
    return DiagonalGaussianDistribution(whole)
