"""Tiny random FLUX.3 checkpoints in the real diffusers folder layout, written by diffusers' modular pipeline's own
``save_pretrained`` (transformer sharded, with its index): a tiny Qwen3-VL text encoder of the real class and its
processor, built offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from paradit.offline_tokenizer import build_offline_tokenizer
from tests.checkpoints import randomize, tiny_vae

TEXT_HIDDEN = 16
# Qwen3-VL-4B's 36: the recipe stacks hidden states 4, 8, ..., 32, none of them the last (normed) one.
TEXT_LAYERS = 36


def tiny_transformer_config(flow_map: bool, heads: int = 3) -> dict:
    """Head dim 16 over the four rotary axes (t, h, w, l); 8 stacked text layers of 16."""
    return {
        "in_channels": 16,
        "cond_in_channels": 16,
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": heads,
        "joint_attention_dim": 8 * TEXT_HIDDEN,
        "timestep_channels": 32,
        "axes_dims_rope": [4, 4, 4, 4],
        "flow_map": flow_map,
    }


def tiny_transformer(flow_map: bool, seed: int = 0, heads: int = 3) -> Flux3Transformer2DModel:
    torch.manual_seed(seed)
    transformer = Flux3Transformer2DModel(**tiny_transformer_config(flow_map, heads))
    randomize(transformer)
    return transformer.eval()


def tiny_text_encoder() -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL with a 36-layer, 16-wide language model and a one-block vision tower (prompts never show it)."""
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1]},
            "pad_token_id": 0,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": TEXT_HIDDEN,
            "deepstack_visual_indexes": [],
        },
        image_token_id=263,
        video_token_id=264,
        vision_start_token_id=261,
        vision_end_token_id=262,
    )
    torch.manual_seed(7)
    return Qwen3VLForConditionalGeneration(config).eval()


class TextOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor, which needs torchvision (not installed here): what diffusers'
    FLUX.3 text encoder step calls for the chat template and its tokenizer."""

    def check_argument_for_proper_class(self, name, argument):
        return None if argument is None else super().check_argument_for_proper_class(name, argument)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Its tokenizer (with the chat template) and image processor, as a published ``tokenizer`` folder holds."""
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)


def tiny_processor() -> TextOnlyProcessor:
    tokenizer = build_offline_tokenizer(8192)
    return TextOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )


def tiny_flux3_vae() -> AutoencoderKLFlux2:
    """FLUX.2's tiny VAE (4 latent channels, packed 2x2 into the transformer's 16), its batch-norm statistics drawn."""
    torch.manual_seed(3)
    return tiny_vae().eval()


def build_flux3_checkpoint(folder: Path, flow_map: bool = False, seed: int = 0, heads: int = 3) -> Path:
    """The base model (``flow_map`` False, Flux3ModularPipeline) or the step-distilled one (Flux3DistilledModular-
    Pipeline), as diffusers' modular pipeline saves it."""
    blocks = Flux3DistilledAutoBlocks() if flow_map else Flux3AutoBlocks()
    pipe = blocks.init_pipeline()
    pipe.update_components(
        transformer=tiny_transformer(flow_map, seed, heads),
        vae=tiny_flux3_vae(),
        text_encoder=tiny_text_encoder(),
        tokenizer=tiny_processor(),
    )
    pipe.save_pretrained(str(folder), max_shard_size="100KB", overwrite_modular_index=True)
    # The index names the processor by the class a published folder loads it with, not this test's stand-in.
    index_path = folder / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    index["tokenizer"][:2] = index["tokenizer"][2]["type_hint"] = ["transformers", "AutoProcessor"]
    index_path.write_text(json.dumps(index, indent=2))
    return folder
