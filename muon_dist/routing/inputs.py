"""The inputs observation runs a model's forward on: the caller's, else the model's own.

A transformers model's own: its ``dummy_inputs`` (token ids; the first sequence, since
every product's codes are held per token); for a vision model one image of its config's
``image_size`` (224 pixels square, the common default, where it names none); and for a
vision-language model an image too: ``get_image_features`` on pixels sized by its vision
config where the model has that call, else the image inputs its forward names as its
image processor (the one transformers registers for its config) makes them of one blank
image of the vision config's size (Mllama's tiles, aspect ratio ids and mask), passed with
the token ids. The plan with the image comes first and the token ids alone second, so a
forward that rejects the image is still observed on its text.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

Call = tuple[str | None, tuple[Any, ...], dict[str, Any]]
"""``(method or None for the forward, args, kwargs)``."""


@dataclass(frozen=True)
class Inputs:
    """One plan: calls observed together; ``label`` names their inputs in the log."""

    label: str
    calls: list[Call]
    guessed: bool = False  # not the model's own inputs: a guess at what its forward takes


def plans(model: nn.Module, example_inputs: Any) -> list[Inputs]:
    """The plans to observe ``model`` on, richest first: ``example_inputs`` (a dict of
    keyword arguments, a tuple of positional ones or one tensor), else the model's own;
    none where it has none."""
    if example_inputs is not None:
        if isinstance(example_inputs, Mapping):
            return [Inputs("example_inputs", [(None, (), dict(example_inputs))])]
        if isinstance(example_inputs, tuple):
            return [Inputs("example_inputs", [(None, example_inputs, {})])]
        return [Inputs("example_inputs", [(None, (example_inputs,), {})])]
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if main == "pixel_values":
        pixels = _pixels(config)
        if pixels is None:
            return []
        label = f"one {pixels.shape[-2]}x{pixels.shape[-1]} image"
        ids = {"input_ids": torch.zeros(1, 4, dtype=torch.long)} if _requires_ids(model) else {}
        label += " and 4 token ids" * bool(ids)  # a grounded detector reads both
        return [Inputs(label, [(None, (), {"pixel_values": pixels, **ids, **_decoder(model)})])]
    if main == "states":
        return _trajectory(config)
    if main in ("input_features", "input_values"):
        audio = _audio(config, main)
        if audio is None:
            return []
        label = f"{main} of {audio.shape[-1]} frames" + (" and decoder ids" * bool(_decoder(model)))
        return [Inputs(label, [(None, (), {main: audio, **_decoder(model)})])]
    dummy = getattr(model, "dummy_inputs", None)
    if main is None and config is None:
        return _token_guess(model)
    if main != "input_ids" or not isinstance(dummy, Mapping):
        return []
    first = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in dummy.items()}
    first = {**_decoder(model, first.get("input_ids")), **first}
    text: Call = (None, (), {**first, **_with_cache(model)})
    plain = Inputs("its dummy token ids", [text])
    found = [_paired_image(model, config, text), _image_plan(model, config, text), plain]
    return [plan for plan in found if plan is not None]


def _requires_ids(model: nn.Module) -> bool:
    """Whether the forward requires token ids (no default: Grounding DINO's text)."""
    try:
        found = inspect.signature(model.forward).parameters.get("input_ids")
    except (TypeError, ValueError):
        return False
    return found is not None and found.default is inspect.Parameter.empty


def _trajectory(config: Any) -> list[Inputs]:
    """A Decision Transformer's inputs: 4 steps of states, actions, rewards, returns to go
    and time steps, sized by its config's ``state_dim`` and ``act_dim``."""
    states, actions = getattr(config, "state_dim", None), getattr(config, "act_dim", None)
    if not isinstance(states, int) or not isinstance(actions, int):
        return []
    steps = 4
    given = {
        "states": torch.zeros(1, steps, states),
        "actions": torch.zeros(1, steps, actions),
        "rewards": torch.zeros(1, steps, 1),
        "returns_to_go": torch.zeros(1, steps, 1),
        "timesteps": torch.zeros(1, steps, dtype=torch.long),
        "attention_mask": torch.ones(1, steps, dtype=torch.long),
    }
    return [Inputs(f"a trajectory of {steps} steps", [(None, (), given)])]


def _token_guess(model: nn.Module) -> list[Inputs]:
    """For a model that names no inputs (no transformers model), whose forward takes one
    required argument and whose first module with parameters is an embedding table: one
    sequence of 8 token ids, a guess (where its forward refuses them, it was not
    observed)."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    required = [p for p in parameters if p.default is p.empty and p.kind in _POSITIONAL]
    first = next((m for m in model.modules() if next(m.parameters(False), None) is not None), None)
    if len(required) != 1 or not isinstance(first, nn.Embedding):
        return []
    ids = torch.zeros(1, 8, dtype=torch.long)
    return [Inputs("8 token ids (it names no inputs)", [(None, (ids,), {})], guessed=True)]


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _decoder(model: nn.Module, ids: Any = None) -> dict[str, torch.Tensor]:
    """``decoder_input_ids`` for an encoder-decoder whose forward names them (the token ids
    given, else the config's decoder start token): without them its decoder is not run."""
    config = getattr(model, "config", None)
    named = _named_parameters(model)
    if not getattr(config, "is_encoder_decoder", False) or "decoder_input_ids" not in named:
        return {}
    if isinstance(ids, torch.Tensor):
        return {"decoder_input_ids": ids}
    start = getattr(config, "decoder_start_token_id", None)
    start = start if isinstance(start, int) and not isinstance(start, bool) else 0
    return {"decoder_input_ids": torch.full((1, 2), start, dtype=torch.long)}


def _paired_image(model: nn.Module, config: Any, text: Call) -> Inputs | None:
    """The token ids with an image in one call, for a dual encoder (CLIP, SigLIP): a forward
    that names both and a config with a vision config but no image token (a
    vision-language model splices its image into the text instead: :func:`_image_plan`)."""
    vision = getattr(config, "vision_config", None)
    tokens = ("image_token_id", "image_token_index")
    if vision is None or any(getattr(config, t, None) is not None for t in tokens):
        return None
    if "pixel_values" not in _named_parameters(model):
        return None
    pixels = _pixels(vision)
    if pixels is None:
        return None
    method, args, kwargs = text
    label = f"its dummy token ids with one {pixels.shape[-2]}x{pixels.shape[-1]} image"
    return Inputs(label, [(method, args, {**kwargs, "pixel_values": pixels})])


def _audio(config: Any, main: str) -> torch.Tensor | None:
    """One blank clip as the config sizes it: Whisper's ``input_features`` ``[1, mel bins,
    2 * max_source_positions]`` (the length its encoder asks for), Speech2Text's ``[1,
    frames, features]``, or a second of raw ``input_values`` at 16 kHz."""
    if main == "input_values":
        return torch.zeros(1, 16000)
    mels = getattr(config, "num_mel_bins", None)
    positions = getattr(config, "max_source_positions", None)
    if isinstance(mels, int) and isinstance(positions, int):
        return torch.zeros(1, mels, 2 * positions)
    per_channel = getattr(config, "input_feat_per_channel", None)
    channels = getattr(config, "input_channels", 1)
    if isinstance(per_channel, int) and isinstance(channels, int):
        return torch.zeros(1, 64, per_channel * channels)
    return None


def _image_plan(model: nn.Module, config: Any, text: Call) -> Inputs | None:
    """The token ids with an image, for a model whose config has a ``vision_config``."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    if callable(getattr(model, "get_image_features", None)):
        pixels = _pixels(vision)
        if pixels is None:
            return None
        call: Call = ("get_image_features", (), {"pixel_values": pixels})
        return Inputs("its dummy token ids and get_image_features on an image", [text, call])
    image = _processed_image(config, vision, _named_parameters(model))
    if not image:
        return None
    method, args, kwargs = text
    return Inputs(
        f"its dummy token ids with {', '.join(image)} of a blank image from its image processor",
        [(method, args, {**kwargs, **image})],
    )


def _processed_image(config: Any, vision: Any, accepted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors among ``accepted`` (``pixel_values`` one of them) that the image
    processor registered for ``config`` makes of one blank image, sized to
    ``vision.image_size``; none where there is no such processor or it refuses."""
    size = getattr(vision, "image_size", None)
    channels = getattr(vision, "num_channels", 3)
    if "pixel_values" not in accepted or not isinstance(size, int) or not isinstance(channels, int):
        return {}
    processor = _image_processor(config, size)
    if processor is None:
        return {}
    try:
        blank = torch.zeros(channels, size, size, dtype=torch.uint8)
        made = processor(images=blank, return_tensors="pt")
    except Exception as e:  # an image processor raises what it likes on inputs it refuses
        logger.info(
            "muon_dist.param_groups: %s made no inputs of a blank %dx%d image (%s: %s); "
            "observed without an image",
            type(processor).__name__,
            size,
            size,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return {}
    return {k: v for k, v in made.items() if k in accepted and isinstance(v, torch.Tensor)}


def _image_processor(config: Any, side: int) -> Any:
    """The image processor transformers registers for ``config``'s class, resizing to
    ``side`` pixels square; None where there is none (no transformers, no image model)."""
    try:
        auto = importlib.import_module("transformers.models.auto.image_processing_auto")
        registered = auto.IMAGE_PROCESSOR_MAPPING[type(config)]
    except (ImportError, KeyError, AttributeError):
        return None
    if isinstance(registered, Mapping):  # one class per image backend: any will do
        registered = next((c for c in registered.values() if c is not None), None)
    try:
        return None if registered is None else registered(size={"height": side, "width": side})
    except (ImportError, TypeError, ValueError) as e:  # a missing backend, a size it refuses
        logger.info("muon_dist.param_groups: %s refused a %d-pixel size: %s", registered, side, e)
        return None


def _named_parameters(model: nn.Module) -> set[str]:
    """The keyword arguments the model's forward names (not a ``**kwargs`` catch-all)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in named}


def _with_cache(model: nn.Module) -> dict[str, Any]:
    """``use_cache=True`` where the forward takes it: without a cache, transformers reads
    the position ids' values to find packed sequences, which meta tensors do not have
    (the cache changes no op that touches a weight)."""
    return {"use_cache": True} if "use_cache" in _named_parameters(model) else {}


def _pixels(config: Any) -> torch.Tensor | None:
    """One image as the config (or its backbone's, or its vision config's) sizes it; 224
    pixels square where it names no size (a detector's anchors must outnumber its queries:
    RT-DETR's 300 need more than 64 pixels give)."""
    backbone = getattr(config, "backbone_config", None)
    vision = getattr(config, "vision_config", None)
    channels = getattr(config, "num_channels", getattr(backbone, "num_channels", None))
    if channels is None and vision is not None:
        return _pixels(vision)
    if not isinstance(channels, int):
        return None
    size = getattr(config, "image_size", 224)
    if isinstance(size, int):
        return torch.zeros(1, channels, size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return torch.zeros(1, channels, int(size[0]), int(size[1]))
    return None
