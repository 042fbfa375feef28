"""Images as token ids: what the vision families built on a text family's engine share.

A vision-language diffusion model here keeps its language family's engine unchanged (its
samplers, caches, batching, row selection and the server see only token ids). Its image features
enter as ids past the text vocabulary: `SlotStore.add(features)` keeps one image's features (n, H)
and returns n ids, `vocab_size + k` for the k-th stored row; `SlotStore.embed` reads such ids from
the stored rows and every other id from the token embedding (the references' `inputs_embeds` with
the features spliced in). The store keeps the most recent `limit` rows, so a long-running server
forgets old images rather than growing without bound; a prompt that still names forgotten rows is
refused with a message rather than read wrongly.
"""

from typing import List

import mlx.core as mx


class ImageSlotError(ValueError):
    pass


class SlotStore:
    """Image features by slot (id - vocab_size), outside any parameter tree."""

    def __init__(self, name: str, vocab_size: int, limit: int):
        self.name = name
        self.vocab_size = vocab_size
        self.limit = limit
        self.features = []
        self.base = 0  # the slot of features[0]'s first row
        self.table = None  # features concatenated: built once per change, not every forward

    @property
    def stored_rows(self) -> int:
        return sum(f.shape[0] for f in self.features)

    def add(self, features: mx.array) -> List[int]:
        """Ids that stand for one image's features (n, H); the oldest images go past `limit`."""
        mx.eval(features)
        stored = self.stored_rows
        while self.features and stored + features.shape[0] > self.limit:
            dropped = self.features.pop(0)
            self.base += dropped.shape[0]
            stored -= dropped.shape[0]
        first = self.vocab_size + self.base + stored
        self.features.append(features)
        self.table = None
        return list(range(first, first + features.shape[0]))

    def is_image_id(self, token_id: int) -> bool:
        """Whether `token_id` stands for a stored feature row: ids past the vocabulary that name
        no stored row (never given, or dropped since) are not, so a request's check refuses them
        before decoding."""
        first = self.vocab_size + self.base
        return first <= token_id < first + self.stored_rows

    def embed(self, embed_tokens, inputs: mx.array) -> mx.array:
        """Token embeddings of `inputs`, with image ids read from the stored features."""
        vocab = self.vocab_size
        is_image = inputs >= vocab
        h = embed_tokens(mx.where(is_image, 0, inputs))
        if not bool(is_image.any().item()):
            return h
        index = inputs - vocab - self.base
        if bool((is_image & (index < 0)).any().item()):
            raise ImageSlotError(
                f"{self.name}: the prompt holds image ids whose features were dropped (more than "
                f"{self.limit} image features were stored since); encode its images again"
            )
        if self.table is None and self.features:
            self.table = mx.concatenate(self.features, axis=0)
        table = self.table
        if table is None or bool((is_image & (index >= table.shape[0])).any().item()):
            raise ImageSlotError(
                f"{self.name}: the prompt holds token ids past the vocabulary ({vocab}) that stand "
                "for no stored image; give images through the processor (image=...), not as ids"
            )
        feats = table.astype(h.dtype)[mx.where(is_image, index, 0)]
        return mx.where(is_image[..., None], feats, h)


class SlotProcessor:
    """What the processors of these families share (`load` returns one with the model): the
    tokenizer's own attributes (decode, chat template, EOS ids, ...) pass through; a prompt is split
    at `image_token`, its text encoded by the tokenizer and each placeholder replaced by
    `image_ids(image)` (the family's markers around the image's feature ids). A family defines
    `image_token`, `preprocess` and `image_ids`."""

    image_token = "<image>"

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = self.preprocess

    def __getattr__(self, name):
        if name in ("model", "tokenizer"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def preprocess(self, image):
        raise NotImplementedError

    def image_ids(self, image) -> List[int]:
        raise NotImplementedError

    def __call__(self, text, images=(), add_special_tokens=True):
        (prompt,) = text
        chunks = prompt.split(self.image_token)
        if len(chunks) - 1 != len(images):
            raise ValueError(
                f"the prompt holds {len(chunks) - 1} {self.image_token} placeholders for "
                f"{len(images)} images; give one per image"
            )
        encoded = self.chunk_ids(chunks, add_special_tokens)
        ids = encoded[0]
        for image, chunk in zip(images, encoded[1:]):
            ids += self.image_ids(image)
            ids += chunk
        return {"input_ids": [ids], "pixel_values": None}

    def chunk_ids(self, chunks: List[str], add_special_tokens: bool) -> List[List[int]]:
        """The ids of the text between the placeholders: the first chunk with the special tokens
        asked for, the others as a continuation (none)."""
        first = list(self.tokenizer.encode(chunks[0], add_special_tokens=add_special_tokens))
        rest = [list(self.tokenizer.encode(c, add_special_tokens=False)) for c in chunks[1:]]
        return [first] + rest
