"""Frozen configuration dataclasses.

`ModelConfig` describes one SGRAF network. Its defaults are the authors' (official.md); the
ablation switches of the paper's Tables 3, 4 and 5 are fields, so each table row is one
configuration. Checkpoints store `ModelConfig.to_dict()` and rebuild with `from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from sgraf.errors import InputError

MODULES = ("sgr", "saf", "ave", "joint")
SIMILARITIES = ("vector", "scalar")
ATTENTIONS = ("t2i", "i2t")
ALIGNMENTS = ("both", "global", "local")
POSITIONS = ("none", "box", "relation", "place")  # region positions: sgraf.model.positions
PRECISIONS = ("fp32", "bf16", "fp16")             # what `sgraf.precision.autocast` runs


def unused_settings(settings: Any) -> dict[str, str]:
    """The model settings that have no effect under the others, each with why: `sgr_step` without
    an SGR head, the attention's `attention` and `lambda_softmax` with global alignments only,
    `sim_dim` with scalar (cosine) similarities, the place term's settings without one; and, of a
    training config, `family_share` without family batches.
    `settings`: a `ModelConfig`, or a mapping of its fields (a run's config.yaml; missing fields
    take the defaults)."""
    values = settings.to_dict() if isinstance(settings, ModelConfig) else dict(settings)
    default = {field.name: field.default for field in dataclasses.fields(ModelConfig)}

    def get(name: str) -> Any:
        return values.get(name, default.get(name))

    unused = {}
    if get("module") not in ("sgr", "joint"):
        unused["sgr_step"] = f"module={get('module')} has no SGR head"
    if get("alignments") == "global":
        unused["attention"] = unused["lambda_softmax"] = "alignments=global has no local (attended) alignments"
    if get("similarity") == "scalar":
        unused["sim_dim"] = "similarity=scalar compares by cosine, with no similarity vectors"
    if get("positions") != "place":
        unused["place_sharpness"] = unused["place_penalty"] = f"positions={get('positions')} has no place term"
    if "family_share" in values and values.get("batches", "random") != "families":
        unused["family_share"] = f"batches={values.get('batches', 'random')} draws no families"
    return unused


@dataclass(frozen=True)
class ModelConfig:
    """One SGRAF network.

    Attributes:
        vocab_size: number of word ids (the vocabulary's length).
        img_dim: size of each region feature (2048 for Faster R-CNN precomp features).
        word_dim: word embedding size.
        embed_size: joint embedding size d.
        sim_dim: similarity representation size m.
        num_regions: regions K per image (BatchNorm1d over the K region slots).
        num_layers: GRU layers.
        bi_gru: bidirectional GRU (forward and backward states averaged).
        img_norm: l2-normalise region embeddings (the authors' `no_imgnorm=False`).
        txt_norm: l2-normalise word embeddings (the authors' `no_txtnorm=False`).
        module: aggregation head: 'sgr' (Eq. 6-8), 'saf' (Eq. 9), 'ave' (mean of per-alignment
            scores, Table 4) or 'joint' (one similarity representation feeding both SGR and SAF,
            Table 5 "Joint").
        sgr_step: reasoning steps N of SGR (Table 3: 1-4).
        alignments: 'both' (global + local nodes), 'global' only or 'local' only (Table 3).
        similarity: 'vector' (Eq. 1) or 'scalar' (cosine, Table 4).
        attention: 't2i' text-to-image (default) or 'i2t' image-to-text attention (Table 4).
        lambda_softmax: attention temperature (9).
        dropout: dropout after the word embedding (0.4).
        positions: region positions (issue 21, not in the paper): 'none' (the authors' model),
            'box' (an embedding of each region's box added to it in the image encoder),
            'relation' (that, plus self-attention over regions with a pairwise geometry bias) or
            'place' ('box', plus the place term of the similarity stage: the offset between the
            places two words read, scored against the relation word between them,
            `sgraf.model.positions.PlaceTerm`); models other than 'none' need boxes
            (`sgraf.data.boxes`).
        place_sharpness: with positions='place', when scoring (eval mode), each word's place is
            read from its attention over the regions (Eq. 3) at temperature lambda_softmax x this
            (>= 1): 1 reads the attention the similarity nodes use; above 1 a sharper one, so that
            a word's place is its object's rather than a mean drawn towards the picture's centre.
            Training always reads the nodes' attention (the term learns on soft places: trained
            on sharp ones SAF + place learnt slowly; docs/positions.md, "Reading the places").
        place_penalty: with positions='place', the term only lowers a score: its value is
            min(term, 0), so a stated relation lowers a caption on a picture where it is false and
            raises none where it holds (the signed term raised "a red square left of a blue
            circle" on the picture whose square is green too). It is trained with the gradient
            of the signed term (straight-through), so the relation words keep learning from the
            pairs where their relation holds (docs/positions.md, "The penalty").
    """

    vocab_size: int
    img_dim: int = 2048
    word_dim: int = 300
    embed_size: int = 1024
    sim_dim: int = 256
    num_regions: int = 36
    num_layers: int = 1
    bi_gru: bool = True
    img_norm: bool = True
    txt_norm: bool = True
    module: str = "sgr"
    sgr_step: int = 3
    alignments: str = "both"
    similarity: str = "vector"
    attention: str = "t2i"
    lambda_softmax: float = 9.0
    dropout: float = 0.4
    positions: str = "none"
    place_sharpness: float = 1.0
    place_penalty: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "img_dim", "word_dim", "embed_size", "sim_dim", "num_regions",
                     "num_layers", "sgr_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"model config field {name!r} must be a positive integer, got {value!r}")
        choices = {"module": MODULES, "similarity": SIMILARITIES, "attention": ATTENTIONS,
                   "alignments": ALIGNMENTS, "positions": POSITIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"model config field {name!r} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        if self.similarity == "scalar" and self.module != "ave":
            raise InputError("model config: similarity='scalar' (cosine nodes, Table 4) is defined only with "
                             f"module='ave', got module={self.module!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"model config field 'dropout' must be in [0, 1), got {self.dropout!r}")
        if not (isinstance(self.lambda_softmax, (int, float)) and 0 < self.lambda_softmax < math.inf):
            raise InputError(f"model config field 'lambda_softmax' (the attention's inverse temperature, 9 in the "
                             f"paper) must be a finite number > 0, got {self.lambda_softmax!r}")
        if self.positions == "place" and (self.alignments == "global" or self.attention != "t2i"):
            raise InputError("model config: positions='place' reads the place each word attends to: it needs "
                             "alignments 'both' or 'local' and attention 't2i', got "
                             f"alignments={self.alignments!r}, attention={self.attention!r}")
        if self.positions == "place" and self.module == "ave":
            raise InputError("model config: positions='place' adds the place term to the logit of an SGR or SAF head; "
                             "module='ave' has none (the term would be left out unsaid): use module sgr, saf or "
                             "joint, or positions 'box' or 'relation'")
        if not 1.0 <= self.place_sharpness < math.inf:
            raise InputError(f"model config field 'place_sharpness' must be a finite number >= 1, "
                             f"got {self.place_sharpness!r}")
        if self.place_sharpness != 1.0 and self.positions != "place":
            raise InputError(f"model config: place_sharpness={self.place_sharpness!r} is a setting of the place term "
                             f"(positions='place'), got positions={self.positions!r}")
        if not isinstance(self.place_penalty, bool):
            raise InputError(f"model config field 'place_penalty' must be true or false, got {self.place_penalty!r}")
        if self.place_penalty and self.positions != "place":
            raise InputError("model config: place_penalty=true is a setting of the place term (positions='place'), "
                             f"got positions={self.positions!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
                   and f.default is dataclasses.MISSING]
        if missing:
            raise InputError(f"model config lacks the field(s) {', '.join(missing)}")
        return cls(**values)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)
