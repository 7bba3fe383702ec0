"""An Engine serves request after request: a refused one leaves it as it was, and batches behave as asked."""

from __future__ import annotations

import pytest
import torch

from paradit import Engine, GenerationRequest, InvalidRequest

PROMPT = "a lighthouse on a cliff at dusk"


def small(**overrides) -> GenerationRequest:
    fields = {"prompt": PROMPT, "height": 32, "width": 32, "steps": 2, "seed": 11, **overrides}
    return GenerationRequest(**fields)


def state(engine: Engine) -> dict[str, torch.Tensor]:
    pipe = engine.pipeline
    parts = {"transformer": pipe.transformer, "text_encoder": pipe.prompt_encoder.decoder, "vae": pipe.vae}
    return {f"{part}.{k}": v for part, module in parts.items() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("flux2-tiny", device="cpu")


BAD_REQUESTS = [
    (small(height=30), "height 30"),
    (small(width=40), "width 40"),
    (small(steps=0), "steps 0"),
    (small(prompt=""), "prompt is empty"),
    (small(prompt=[PROMPT, " "]), "prompt is empty"),
    (small(guidance=-1.0), "guidance"),
    (small(num_images_per_prompt=0), "num_images_per_prompt 0"),
    (small(prompt=[PROMPT, "a boat"], negative_prompt=["x", "y", "z"]), "3 negative prompts for 2 prompts"),
]


def test_engine_serves_a_valid_request_after_refusing_bad_ones(engine):
    fresh = Engine("flux2-tiny", device="cpu")
    # The assumption the comparison rests on: the tiny preset's random weights are seeded, so two engines built
    # the same way hold identical tensors.
    ours, theirs = state(engine), state(fresh)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    before = {name: tensor.clone() for name, tensor in ours.items()}

    for request, message in BAD_REQUESTS:
        with pytest.raises(InvalidRequest, match=message):
            engine.generate(request)

    result = engine.generate(small())
    expected = fresh.generate(small())
    assert result.pixels.shape == (1, 3, 32, 32)
    assert result.seed == expected.seed == 11
    assert torch.equal(result.pixels, expected.pixels)
    after = state(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)
    # And it keeps serving: the same request again is the same image.
    assert torch.equal(engine.generate(small()).pixels, result.pixels)


def test_two_images_per_prompt_are_different(engine):
    result = engine.generate(small(num_images_per_prompt=2))
    assert result.pixels.shape == (2, 3, 32, 32)
    assert len(result.images) == 2
    first, second = result.pixels
    assert not torch.equal(first, second)
    assert (first - second).abs().mean() > 1e-3
    # Still reproducible: the same seed gives the same pair.
    assert torch.equal(engine.generate(small(num_images_per_prompt=2)).pixels, result.pixels)


def test_other_seed_gives_other_image(engine):
    assert not torch.equal(engine.generate(small(seed=1)).pixels, engine.generate(small(seed=2)).pixels)


def test_negative_prompt_list_of_wrong_length_names_the_counts(engine):
    request = GenerationRequest(prompt=["a cat", "a dog"], negative_prompt=["blurry", "dark", "noisy"], height=32)
    with pytest.raises(InvalidRequest) as info:
        engine.generate(request)
    message = str(info.value)
    assert "3 negative prompts" in message
    assert "2 prompts" in message


def test_negative_prompts_one_per_prompt_or_one_for_all(engine):
    prompts = ["a cat", "a dog"]
    per_prompt = engine.generate(small(prompt=prompts, negative_prompt=["blurry", "blurry"], steps=1))
    shared = engine.generate(small(prompt=prompts, negative_prompt="blurry", steps=1))
    assert per_prompt.pixels.shape == (2, 3, 32, 32)
    assert torch.equal(per_prompt.pixels, shared.pixels)
    # The negative prompt reaches the unconditional branch: it changes the image from the default empty one.
    default = engine.generate(small(prompt=prompts, steps=1))
    assert not torch.equal(default.pixels, shared.pixels)
