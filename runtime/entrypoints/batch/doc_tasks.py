"""Document jobs: a Jinja prompt per chunk, then the per-chunk outputs merged into one per document.

Prompt: `--prompt-file TEMPLATE.j2` (variables: document = the chunk's text, path, chunk_index (0-based),
num_chunks, question) or a built-in `--task`:
  summarize  per-chunk summaries; more than one chunk -> the summaries are summarized again (in groups
             that fit the context, repeated until one is left)
  extract    per-chunk JSON objects of the facts found; merged key by key (lists concatenated without
             duplicates, first non-null scalar kept); chunks whose output is not JSON are kept in "unparsed"
  qa         per-chunk answers to --question; more than one chunk -> one answer from the partial answers
  (template) the chunk outputs joined in order, separated by a blank line
Chunks hold at most (max_seq_len - prompt overhead - max_tokens) document tokens, with `overlap` tokens
shared between neighbours.

Images (`--images`): a chunk's request is one user message, the rendered prompt as a text part followed by
the images of the pages whose text starts in that chunk (the first chunk for an image file or a PDF's
first page) as OpenAI `image_url` parts, so it renders exactly as `LLM.chat` renders those parts. Each image
takes its `<|media_pad|>` rows (the engine's processor plans them from the size alone) plus its media markers;
a document's image tokens are kept free in every chunk's budget. A document is refused, as its error line,
when a chunk would carry more images than the engine's `limits.max_images_per_request` (`too_many_images`)
or when its images' tokens at the engine's patch limit leave no room for text (`images_too_large`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
from moe_export.runtime.client.protocol import EngineClient
from moe_export.common.errors import InputError
from moe_export.runtime.entrypoints.batch.chunking import chunk_text

TASK_TEMPLATES = {
    "summarize": "Summarize the following document in a few sentences.\n\n{{ document }}",
    "extract": (
        "Extract the named entities, dates and numbers stated in the following document. Answer with one JSON "
        'object only, shaped {"entities": [...], "dates": [...], "numbers": [...]}.\n\n{{ document }}'
    ),
    "qa": "Answer the question using only the document. If the document does not say, answer \"not stated\".\n\n"
          "Question: {{ question }}\n\nDocument:\n{{ document }}",
}
REDUCE_TEMPLATES = {
    "summarize": "These are summaries of consecutive parts of one document. Write one summary of the whole "
                 "document.\n\n{{ document }}",
    "qa": "These are answers to the question from consecutive parts of one document. Give one final answer.\n\n"
          "Question: {{ question }}\n\nPartial answers:\n{{ document }}",
}
OVERHEAD_MARGIN = 8  # tokens kept free beyond the measured prompt overhead


class OverLongDocument(InputError):
    """A document that needs more than --max-chunks chunks."""


class RefusedImages(InputError):
    """A document whose images the engine's limits do not admit; `code` names the limit."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DocJob:
    """What to do with every document (picklable: sent to Ray actors)."""

    template: str  # Jinja source of the per-chunk prompt
    task: str | None  # summarize | extract | qa, or None for a user template
    question: str | None = None
    overlap: int = 64
    max_chunks: int = 64
    max_tokens: int = 256
    reasoning_effort: str | None = None
    images: bool = False  # --images: image files and PDF images go with the documents

    def __post_init__(self) -> None:
        """The numeric options and the effort checked before anything runs (no error line per item)."""
        from moe_export.runtime.core.budget import resolve_thinking

        for flag, value, least in (("--overlap", self.overlap, 0), ("--max-chunks", self.max_chunks, 1),
                                   ("--max-tokens", self.max_tokens, 1)):
            if value < least:
                raise InputError(f"{flag} must be >= {least}, got {value}")
        if self.reasoning_effort is not None:
            try:
                resolve_thinking(self.reasoning_effort, {}, "max")
            except InputError:
                raise InputError(f"--reasoning-effort must be low, high, max, none or a number of tokens, got "
                                 f"{self.reasoning_effort!r}") from None

    @classmethod
    def make(cls, task: str | None, prompt_file: str | None, question: str | None, **kw) -> DocJob:
        if (task is None) == (prompt_file is None):
            raise InputError("documents need exactly one of --task summarize|extract|qa and --prompt-file TEMPLATE.j2")
        if task is not None and task not in TASK_TEMPLATES:
            raise InputError(f"--task {task}: expected one of {', '.join(TASK_TEMPLATES)}")
        if task == "qa" and not question:
            raise InputError("--task qa needs --question")
        if prompt_file is not None:
            try:
                source = Path(prompt_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"--prompt-file {prompt_file}: cannot read ({exc})") from None
        else:
            source = TASK_TEMPLATES[task]
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        try:
            env.from_string(source).render(document="", path="", chunk_index=0, num_chunks=1, question=question or "")
        except jinja2.TemplateError as exc:
            raise InputError(f"prompt template {prompt_file or task}: {exc}") from None
        return cls(template=source, task=task, question=question, **kw)


def chunk_budget(job: DocJob, tokenizer, family: str | None, max_seq_len: int) -> int:
    """Document tokens per chunk: the context less the empty prompt's tokens (+ a margin) and max_tokens;
    InputError when that leaves no more than the overlap (checked before the engine loads, and by DocRunner)."""
    from moe_export.runtime.chat import render_ids

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    empty = [{"role": "user", "content": env.from_string(job.template).render(
        document="", path="", chunk_index=0, num_chunks=1, question=job.question or "")}]
    overhead = len(render_ids(tokenizer, empty, family=family)) + OVERHEAD_MARGIN
    budget = max_seq_len - overhead - job.max_tokens
    if budget <= job.overlap:
        raise InputError(
            f"the engine's context ({max_seq_len} tokens) leaves {budget} document tokens per chunk after the "
            f"prompt ({overhead}) and max_tokens ({job.max_tokens}); need more than the overlap ({job.overlap})"
        )
    return budget


class DocRunner:
    """Runs a DocJob's documents on one AsyncLLM; `semaphore` bounds the requests in flight."""

    def __init__(self, llm: EngineClient, job: DocJob, max_seq_len: int, semaphore) -> None:
        from moe_export.runtime.request_options import parse_request_options

        self.llm, self.job, self.semaphore = llm, job, semaphore
        self.vision = llm.processor.vision
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        self.prompt = env.from_string(job.template)
        self.reduce = env.from_string(REDUCE_TEMPLATES[job.task]) if job.task in REDUCE_TEMPLATES else None
        self.sampling = parse_request_options({"max_tokens": job.max_tokens}, llm.default_sampling,
                                              where="job").sampling
        self.count = lambda text: len(llm.tokenizer.encode(text))
        self.budget = chunk_budget(job, llm.tokenizer, llm.family, max_seq_len)

    def image_tokens(self, path: str, images: list[dict]) -> int:
        """Prompt tokens the images take (pads + markers; the plans from each image's size alone), or
        RefusedImages when the engine's limits do not admit them."""
        import base64
        import io

        from moe_export.runtime.images import image_token_ids
        from PIL import Image

        if self.vision is None:
            raise InputError(f"{path}: this engine has no vision tower, so it takes no images")
        total = 0
        for im in images:
            with Image.open(io.BytesIO(base64.b64decode(im["url"].partition(",")[2]))) as decoded:
                width, height = decoded.size
            plan = self.vision.processor.plan(width, height)
            total += len(image_token_ids(self.llm.tokenizer, width, height, plan.num_tokens))
        if self.budget - total <= self.job.overlap:
            raise RefusedImages("images_too_large", (
                f"{path}: its {len(images)} image(s) take {total} prompt tokens at the engine's patch limit "
                f"({self.vision.processor.cfg['in_patch_limit']} patches per image, limits.max_image_patches); the "
                f"context leaves {self.budget} tokens per request after the prompt and max_tokens"))
        return total

    def chunk_images(self, path: str, text: str, chunks: list[str], images: list[dict]) -> list[list[dict]]:
        """The images of each chunk: an image goes with the chunk in which its page's text starts."""
        starts, pos = [], 0
        for chunk in chunks:
            pos = text.find(chunk, pos)
            starts.append(pos)
        per_chunk: list[list[dict]] = [[] for _ in chunks]
        for im in images:
            per_chunk[max(i for i, s in enumerate(starts) if s <= im["offset"] or i == 0)].append(im)
        limit = self.vision.max_images
        for i, group in enumerate(per_chunk):
            if limit is not None and len(group) > limit:
                sources = ", ".join(im["source"] for im in group)
                raise RefusedImages("too_many_images", (
                    f"{path}: {len(group)} images in one request (chunk {i + 1} of {len(chunks)}: {sources}); the "
                    f"engine takes at most {limit} per request (limits.max_images_per_request)"))
        return per_chunk

    async def _ask(self, content: str, usage: dict, images: list[dict] = ()) -> str:
        kwargs = {} if self.job.reasoning_effort is None else {"reasoning_effort": self.job.reasoning_effort}
        if images:
            content = [{"type": "text", "text": content},
                       *({"type": "image_url", "image_url": {"url": im["url"]}} for im in images)]
        async with self.semaphore:
            out = await self.llm.chat([{"role": "user", "content": content}], self.sampling, **kwargs)
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            usage[key] += out.usage.get(key, 0)
        usage["requests"] += 1
        return out.content or ""

    async def run(self, path: str, text: str, images: list[dict] = ()) -> dict:
        """One document (its text, and with --images its images) -> response body {"output", "chunks",
        "chunk_outputs", "usage", "images"}; OverLongDocument if it needs more than max_chunks chunks,
        RefusedImages if the engine's image limits do not admit its images."""
        import asyncio

        budget = self.budget - (self.image_tokens(path, list(images)) if images else 0)
        if len(text) > self.job.max_chunks * budget * 16:  # > 16 characters per token cannot fit
            raise OverLongDocument(f"{path}: {len(text)} characters cannot fit in {self.job.max_chunks} chunks (--max-chunks)")
        chunks = chunk_text(text, self.count, budget, self.job.overlap)
        if len(chunks) > self.job.max_chunks:
            raise OverLongDocument(f"{path}: needs {len(chunks)} chunks of {budget} tokens, over --max-chunks {self.job.max_chunks}")
        per_chunk = self.chunk_images(path, text, chunks, list(images)) if images else [[] for _ in chunks]
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "requests": 0}
        prompts = [self.prompt.render(document=c, path=path, chunk_index=i, num_chunks=len(chunks),
                                      question=self.job.question or "") for i, c in enumerate(chunks)]
        outputs = await asyncio.gather(*(self._ask(p, usage, ims) for p, ims in zip(prompts, per_chunk)))
        merged = await self._merge(list(outputs), usage)
        body = {"output": merged, "chunks": len(chunks), "chunk_outputs": list(outputs) if len(chunks) > 1 else [],
                "usage": usage}
        if images:
            body["images"] = len(images)
        return body

    async def _merge(self, outputs: list[str], usage: dict):
        if self.job.task == "extract":
            return merge_extractions(outputs)
        if self.reduce is None:
            return "\n\n".join(outputs)
        import asyncio

        while len(outputs) > 1:
            groups = pack_groups(outputs, self.count, self.budget)
            if all(len(g) == 1 for g in groups):  # every partial output alone fills a chunk: stop reducing
                return "\n\n".join(outputs)
            outputs = await asyncio.gather(*(
                self._ask(self.reduce.render(document="\n\n".join(g), question=self.job.question or ""), usage)
                if len(g) > 1 else asyncio.sleep(0, g[0]) for g in groups))
        return outputs[0]


def pack_groups(parts: list[str], count, budget: int) -> list[list[str]]:
    """Consecutive parts packed greedily into groups whose joined text fits `budget` tokens."""
    groups: list[list[str]] = []
    for part in parts:
        if groups and count("\n\n".join([*groups[-1], part])) <= budget:
            groups[-1].append(part)
        else:
            groups.append([part])
    return groups


def _merge_values(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = _merge_values(out[key], value) if key in out else value
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = list(a)
        for value in b:
            if value not in out:
                out.append(value)
        return out
    return b if a is None else a


def merge_extractions(outputs: list[str]) -> dict:
    """Per-chunk JSON objects merged key by key; outputs that are not a JSON object go to "unparsed"."""
    merged: dict = {}
    unparsed = []
    for text in outputs:
        try:
            value = json.loads(text.strip().removeprefix("```json").removeprefix("```").removesuffix("```"))
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            merged = _merge_values(merged, value)
        else:
            unparsed.append(text)
    if unparsed:
        merged["unparsed"] = unparsed
    return merged
