"""The shapes of the JSON answers, for the OpenAPI schema at `/openapi.json` and `/docs`.

The routes return the dicts `SearchService` builds; these pydantic models document them (and
FastAPI checks the answers against them).
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, Field


class ErrorAnswer(BaseModel):
    error: str = Field(description="what is wrong with the request, in one line")


class ImageResult(BaseModel):
    id: int = Field(description="image index in the gallery (the split's order)")
    score: Optional[float] = Field(description="the full SGRAF score (ensemble mean)")
    image: Optional[str] = Field(description="URL path of the picture, or null when the gallery has none")
    name: Optional[str] = Field(default=None, description="the picture's name (its file name for `sgraf extract` "
                                                          "data, its image id for converted TSV), or null")


class CaptionResult(BaseModel):
    id: int = Field(description="caption index in the gallery (the split's order)")
    score: Optional[float] = Field(description="the full SGRAF score (ensemble mean)")
    caption: Optional[str] = Field(description="the caption")
    explainable: bool = Field(default=True, description="whether the caption is within the text limit of "
                                                        "`/api/explain` (a gallery caption may be longer)")


class ImageQuery(BaseModel):
    image_id: int
    image: Optional[str] = Field(description="URL path of the query's picture, or null")
    name: Optional[str] = Field(default=None, description="the query picture's name, or null")


class SearchAnswer(BaseModel):
    query: Union[str, ImageQuery] = Field(description="the text, or the query image")
    results: list[Union[ImageResult, CaptionResult]] = Field(
        description="best first: images for a text query, captions for an image query")
    ms: float = Field(description="milliseconds from the request's arrival to the answer, queueing included")


class Node(BaseModel):
    label: str = Field(description="'[global]' or a token ('<start>' and '<end>' included)")
    saf_beta: Optional[float] = Field(description="SAF's weight on this alignment (null without a SAF head)")
    sgr_alignment: Optional[float] = Field(
        description="cosine of SGR's reasoned read-out with this raw alignment (null without an SGR head)")


class Attention(BaseModel):
    model: Optional[str] = Field(description="the model whose text-to-image attention this is")
    tokens: list[str]
    weights: list[list[Optional[float]]] = Field(description="per token, its attention over the K regions")


class Regions(BaseModel):
    kind: str = Field(description="'grid' (rows x cols, row-major over the picture) or 'boxes'")
    source: str
    rows: Optional[int] = None
    cols: Optional[int] = None
    boxes: Optional[list[list[Optional[float]]]] = Field(
        default=None, description="per region, x0, y0, x1, y1 in the picture's pixels (a grid's cells too)")
    width: Optional[int] = None
    height: Optional[int] = None


class ExplainAnswer(BaseModel):
    image_id: int
    text: str
    image: Optional[str]
    scores: dict[str, Optional[float]] = Field(description="per model ('sgr', 'saf', ...) and 'ensemble'")
    nodes: list[Node]
    attention: Optional[Attention]
    regions: Regions
    unknown: list[int] = Field(description="positions in the tokens (<start> first) of words the vocabulary does "
                                           "not know, read as <unk> (allow_unknown)")
    ms: float


class ModelInfo(BaseModel):
    module: Optional[str]
    embed_size: Optional[int]
    weights_sha256: str
    source: Optional[str]


class HealthAnswer(BaseModel):
    status: str
    changed: list[str]
    index: str
    gallery: dict[str, Optional[int]]
    models: list[ModelInfo]
    device: str
    precision: str
    torch_threads: int
    shortlist: int
    first_stage: str
    pictures: bool
    explain: bool
    limits: dict[str, int]
    queue: dict[str, int]
