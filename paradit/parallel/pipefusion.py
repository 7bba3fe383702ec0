"""PipeFusion: the blocks split into pipeline stages, image patches flowing through them against stale K/V.

The low-communication strategy for slow links. FLUX.2's blocks (the double-stream blocks, then the single-stream
ones, as one sequence) are split into P contiguous stages; rank p of the pipefusion group keeps only stage p's
blocks and frees the rest. Every rank runs ``embed`` (cheap, and every stage needs the modulation vectors and
rotary tables); activations pass point to point from stage p to stage p + 1; the last stage runs ``head`` and
broadcasts the prediction, which every rank needs for its scheduler step.

- **Warm-up steps** (the first ``warmup_steps`` of a request) run the whole sequence as one piece: a plain layer
  pipeline, exactly the serial result. They also fill each attention layer's K/V buffer.
- **Patched steps** split the image tokens into ``patches`` contiguous patches (row bands) that enter the pipeline
  one after another, so stage p works on patch m while stage p + 1 works on patch m - 1. Each attention layer
  writes the patch's fresh K/V over its rows of the buffer and attends to the whole buffer: rows of earlier patches
  are this step's, rows of later patches the previous step's (stale), an approximation that neighbouring diffusion
  steps make small.

Text tokens travel with the first patch only, so they are computed once per step: patch 0 is [text, image band 0],
a contiguous range of the [text, image] sequence, and the later patches carry a zero-length text stream. Their
attention reads this step's text K/V, which patch 0 wrote into the buffer before them in every layer.

The step index comes from ``begin_request()``, which the pipeline calls before its denoise loop, and one count per
forward (FLUX.2's pipeline calls the transformer once per step, with both guidance branches batched).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paradit.errors import InvalidRequest
from paradit.layers.attention import sdpa_attention
from paradit.models.flux2 import Flux2Tokens, Flux2Transformer
from paradit.parallel.comm import broadcast, split_sizes
from paradit.parallel.mesh import ParallelContext


@dataclass
class Window:
    """The rows of the whole [text, image] sequence (``total`` tokens) the tokens in flight occupy."""

    start: int = 0
    stop: int = 0
    total: int = 0


class StaleKVAttention:
    """One attention layer's K/V buffer over the whole sequence: the tokens in flight write their rows, then attend
    to every row (fresh for this step where already written, stale from the previous step elsewhere)."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if key_mask is not None:
            raise ValueError("PipeFusion's K/V buffers take no key mask (FLUX.2 passes none)")
        start, stop, total = self.window.start, self.window.stop, self.window.total
        shape = (key.shape[0], total, *key.shape[2:])
        if self.key is None or self.key.shape != shape:
            if (start, stop) != (0, total):  # only a whole-sequence (warm-up) step can fill a new buffer
                raise RuntimeError("PipeFusion patched step without a filled K/V buffer; run a warm-up step first")
            self.key, self.value = key.new_empty(shape), value.new_empty(shape)
        self.key[:, start:stop] = key
        self.value[:, start:stop] = value
        return sdpa_attention(query, self.key, self.value)


def stage_range(blocks: int, stages: int, stage: int) -> range:
    """The indices, in [double blocks, single blocks] order, of the blocks ``stage`` runs."""
    sizes = split_sizes(blocks, stages)
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


class PipeFusion(nn.Module):
    """Wraps a FLUX.2 transformer: this rank runs only its stage's blocks, and the last stage's prediction is
    broadcast to the pipefusion group."""

    def __init__(self, model: Flux2Transformer, context: ParallelContext) -> None:
        super().__init__()
        config = context.config
        self.model = model
        self.context = context
        self.group = context.group("pipefusion")
        self.stages = config.pipefusion
        self.stage = context.local_rank("pipefusion")
        ranks = dist.get_process_group_ranks(self.group)
        self.prev_rank = ranks[self.stage - 1] if self.stage > 0 else None
        self.next_rank = ranks[self.stage + 1] if self.stage + 1 < self.stages else None
        self.last_rank = ranks[-1]
        self.patches = config.patches
        self.warmup_steps = config.warmup_steps
        self.step = 0

        doubles, singles = len(model.transformer_blocks), len(model.single_transformer_blocks)
        if self.stages > doubles + singles:
            raise InvalidRequest(f"pipefusion {self.stages} exceeds the model's {doubles + singles} blocks")
        mine = stage_range(doubles + singles, self.stages, self.stage)
        self.double_blocks = nn.ModuleList(model.transformer_blocks[i] for i in mine if i < doubles)
        self.single_blocks = nn.ModuleList(model.single_transformer_blocks[i - doubles] for i in mine if i >= doubles)
        # The other stages' blocks are dropped, so their weights are freed; the model's own run_blocks is not used.
        model.transformer_blocks = nn.ModuleList()
        model.single_transformer_blocks = nn.ModuleList()

        self.window = Window()
        for block in [*self.double_blocks, *self.single_blocks]:
            block.attn.set_attention_fn(StaleKVAttention(self.window))

    @property
    def config(self):
        return self.model.config

    def begin_request(self) -> None:
        """The next forward is step 0 of a new request: a warm-up step."""
        self.step = 0

    def forward(self, *args, **kwargs) -> torch.Tensor:
        tokens = self.model.embed(*args, **kwargs)
        patches = 1 if self.step < self.warmup_steps else self.patches
        self.step += 1
        batch, image, width = tokens.img.shape
        text = tokens.txt.shape[1]
        self.window.total = text + image
        sends, outputs = [], []
        start = 0
        for index, size in enumerate(split_sizes(image, patches)):
            with_text = index == 0
            # Patch 0 is [text, its image band]: rows [0, text + stop) of the sequence; the others their band alone.
            self.window.start = 0 if with_text else text + start
            self.window.stop = text + start + size
            if self.prev_rank is None:
                img = tokens.img[:, start : start + size]
                txt = tokens.txt if with_text else tokens.txt[:, :0]
            else:
                img = self._receive((batch, size, width), tokens.img)
                txt = self._receive((batch, text, width), tokens.txt) if with_text else tokens.txt[:, :0]
            img, txt = self._run_stage(tokens, img, txt, start)
            if self.next_rank is not None:
                sends += self._send(img, txt if with_text else None)
            else:
                outputs.append(self.model.head(dataclasses.replace(tokens, img=img)))
            start += size
        for work, _ in sends:
            work.wait()
        if self.next_rank is None:
            prediction = torch.cat(outputs, dim=1)
        else:
            channels = self.model.proj_out.out_features
            prediction = tokens.img.new_empty(batch, image, channels)
        return broadcast(prediction, self.last_rank, self.group, self.context.stats)

    def _run_stage(
        self, tokens: Flux2Tokens, img: torch.Tensor, txt: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's blocks over one patch; the rotary rows are the patch's text (if any) and image band."""
        rope = tuple(
            torch.cat([t[: txt.shape[1]], i[start : start + img.shape[1]]], dim=0)
            for t, i in zip(tokens.txt_rope, tokens.img_rope)
        )
        for block in self.double_blocks:
            img, txt = block(img, txt, tokens.mod_img, tokens.mod_txt, rope)
        if self.single_blocks:
            x = torch.cat([txt, img], dim=1)
            for block in self.single_blocks:
                x = block(x, tokens.mod_single, rope)
            txt, img = x.split([txt.shape[1], img.shape[1]], dim=1)
        return img, txt

    def _send(self, img: torch.Tensor, txt: torch.Tensor | None) -> list[tuple[dist.Work, torch.Tensor]]:
        """Post the patch's activations to the next stage, so this stage goes on to its next patch while they travel.
        Returns (work, tensor) pairs: the caller waits on the work at the end of the step, holding the tensor alive
        until then."""
        sends = []
        for tensor in (img, txt) if txt is not None else (img,):
            tensor = tensor.contiguous()
            sends.append((dist.isend(tensor, self.next_rank, group=self.group), tensor))
            self.context.stats.add(tensor.numel() * tensor.element_size())
        return sends

    def _receive(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        tensor = like.new_empty(shape)
        dist.irecv(tensor, self.prev_rank, group=self.group).wait()
        return tensor


def parallelize_pipefusion(model: nn.Module, context: ParallelContext) -> nn.Module:
    if context.config.pipefusion == 1:
        return model
    if not isinstance(model, Flux2Transformer):
        raise InvalidRequest(f"pipefusion supports FLUX.2 only so far, not {type(model).__name__}")
    return PipeFusion(model, context)
