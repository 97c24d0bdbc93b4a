"""OpenAI's Conversations API: a conversation is a list of items (the Responses API's input
items: messages, function calls and their outputs, reasoning) kept under an id, which a
Responses request names as its `conversation` to continue it: the conversation's items come
before the request's input, and the request's input and output items are appended once the
response ends (responses_output.py). Also created, read, updated, listed a page at a time and
edited through `/v1/conversations` (the SDK's `client.conversations`).

The newest `ConversationStore.capacity` conversations are kept in memory (oldest dropped
first), each with its newest `MAX_ITEMS` items (older ones drop likewise); a request adds at
most `MAX_ADDED` items, as OpenAI allows. Only the API server's event loop touches the store.
"""

from __future__ import annotations

import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, NamedTuple, Optional, Sequence

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.server.openapi import App
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.responses_api import Messages, input_messages, items_page, listed_item

MAX_ADDED = 20  # items one request may add (OpenAI's limit)
MAX_ITEMS = 10_000  # items a conversation keeps (its newest)
MAX_METADATA = 16  # metadata pairs; keys up to 64 characters, values up to 512 (OpenAI's)


class ConversationBody(Body):
    items: Optional[List[Dict[str, Any]]] = None
    metadata: Optional[Dict[str, str]] = None


class ItemsBody(Body):
    items: List[Dict[str, Any]]


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: Dict[str, str]
    items: List[Dict[str, Any]] = field(default_factory=list)

    def card(self) -> Dict[str, Any]:
        """The conversation object the API answers."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}


def check_metadata(metadata: Optional[Dict[str, str]]) -> Dict[str, str]:
    """`metadata` as given (None: empty); ApiError 400 naming it beyond OpenAI's limits."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA:
        raise ApiError(400, f"metadata: at most {MAX_METADATA} pairs, got {len(metadata)}",
                       "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(400, f"metadata: keys take at most 64 characters and values 512 "
                                f"(key {key[:80]!r})", "metadata")
    return metadata


def checked_items(items: Sequence[Dict[str, Any]], param: str = "items"
                  ) -> List[Dict[str, Any]]:
    """`items` as the conversation keeps them (each with an id and a status:
    responses_api.listed_item), checked as a Responses input is (ApiError 400 naming the item
    and field) and counted (at most MAX_ADDED)."""
    if len(items) > MAX_ADDED:
        raise ApiError(400, f"{param}: at most {MAX_ADDED} items a request, got {len(items)}",
                       param)
    input_messages(list(items), param)
    return [listed_item(item) for item in items]


class ConversationStore:
    """The newest `capacity` conversations by id (see the module's doc)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: "collections.OrderedDict[str, Conversation]" = collections.OrderedDict()

    def create(self, items: Sequence[Dict[str, Any]], metadata: Dict[str, str]
               ) -> Conversation:
        conv = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata,
                            list(items))
        self._items[conv.id] = conv
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return conv

    def get(self, conversation_id: str, param: str = "conversation_id") -> Conversation:
        """The conversation; ApiError 404 naming `param` where it is not kept."""
        conv = self._items.get(conversation_id)
        if conv is None:
            raise ApiError(404, f"{param}: no conversation {conversation_id!r} (the server "
                                f"keeps the newest {self.capacity})", param, "not_found",
                           "not_found_error")
        return conv

    def add(self, conversation_id: str, items: Sequence[Dict[str, Any]]
            ) -> List[Dict[str, Any]]:
        """Append `items` (already listed) to the conversation (its oldest items beyond
        MAX_ITEMS drop); ApiError 404 where it is not kept."""
        conv = self.get(conversation_id)
        conv.items += items
        del conv.items[:-MAX_ITEMS]
        return list(items)

    def record(self, conversation_id: str, items: Sequence[Dict[str, Any]]) -> None:
        """A finished response's input and output items appended to the conversation it
        continued, unless that conversation was deleted (or dropped) while it ran."""
        if conversation_id in self._items:
            self.add(conversation_id, items)

    def delete(self, conversation_id: str) -> None:
        self.get(conversation_id)
        del self._items[conversation_id]

    def item(self, conversation_id: str, item_id: str) -> Dict[str, Any]:
        """One item of the conversation; ApiError 404 naming item_id where it has none."""
        for item in self.get(conversation_id).items:
            if item["id"] == item_id:
                return item
        raise ApiError(404, f"item_id: no item {item_id!r} in conversation "
                            f"{conversation_id!r}", "item_id", "not_found", "not_found_error")

    def messages(self, conversation_id: str) -> Messages:
        """The conversation as chat messages (what a Responses request continues); ApiError
        404 naming `conversation` where it is not kept."""
        return input_messages(self.get(conversation_id, "conversation").items, "conversation")


class ConversationLink(NamedTuple):
    """The conversation a Responses request continues: where its turn is recorded."""

    store: ConversationStore
    id: str


def conversation_id(value: Any) -> Optional[str]:
    """A Responses request's `conversation`: an id, or {"id": ...}; ApiError 400 else."""
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if value is None or isinstance(value, str) and value:
        return value
    raise ApiError(400, "conversation: must be a conversation id or {\"id\": ...}",
                   "conversation")


def install_conversation_routes(app: App, store: ConversationStore,
                                read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """The /v1/conversations routes over `store`; `read_body`: a JSON body's bytes
    (api.json_body)."""
    app.body_models += [ConversationBody, ItemsBody]

    def page(data: List[Dict[str, Any]]) -> Response:
        return JSONResponse({"object": "list", "data": data,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": False})

    async def conversation_body(request: Request) -> ConversationBody:
        body = parse_body(await read_body(request), ConversationBody)
        extra = sorted(body.model_extra or {})
        if extra:
            raise ApiError(400, f"{extra[0]}: not a field of a conversation (items, "
                                f"metadata)", extra[0])
        return body

    @app.post("/v1/conversations")
    async def create_conversation(request: Request) -> Response:
        body = await conversation_body(request)
        conv = store.create(checked_items(body.items or []), check_metadata(body.metadata))
        return JSONResponse(conv.card())

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str) -> Response:
        return JSONResponse(store.get(conversation_id).card())

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, request: Request) -> Response:
        body = await conversation_body(request)
        if body.items is not None or "metadata" not in body.model_fields_set:
            raise ApiError(400, "metadata: an update sets a conversation's metadata (and "
                                "nothing else)", "metadata")
        conv = store.get(conversation_id)
        conv.metadata = check_metadata(body.metadata)
        return JSONResponse(conv.card())

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str) -> Response:
        store.delete(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted",
                             "deleted": True})

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_items(conversation_id: str, limit: str = "20", order: str = "desc",
                         after: Optional[str] = None) -> Response:
        """A page of the items (the SDK's `conversations.items.list`; its `include` has
        nothing to add: items keep what they were given)."""
        items = store.get(conversation_id).items
        return JSONResponse(items_page(items, limit, order, after, "this conversation"))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_items(conversation_id: str, request: Request) -> Response:
        body = parse_body(await read_body(request), ItemsBody)
        store.get(conversation_id)  # a 404 before the items' 400s
        return page(store.add(conversation_id, checked_items(body.items)))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_item(conversation_id: str, item_id: str) -> Response:
        return JSONResponse(store.item(conversation_id, item_id))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_item(conversation_id: str, item_id: str) -> Response:
        """Drop one item; the answer is the conversation (as OpenAI's)."""
        item = store.item(conversation_id, item_id)
        conv = store.get(conversation_id)
        conv.items.remove(item)
        return JSONResponse(conv.card())
