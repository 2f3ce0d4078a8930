"""Regenerate openai-openapi-subset.json from OpenAI's full OpenAPI document.

    git clone https://github.com/openai/openai-openapi && \
    python tests/openai_schemas/extract.py openai-openapi/openapi.json   # or openapi.yaml

Keeps only the component schemas zllm's tests validate against (ROOTS) and every schema they
reference, transitively, under the document's own `components.schemas` path so that
`#/components/schemas/X` references resolve unchanged. Record the commit you took it from
with --commit; README.md beside this script names the source and its license.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUT = HERE / "openai-openapi-subset.json"
PREFIX = "#/components/schemas/"
# The bodies zllm sends (responses, stream chunks and events, errors) and the requests it
# reads (for the walk over their fields in tests/test_openai_schemas.py).
ROOTS = (
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateEmbeddingResponse",
    "Response",
    "ResponseStreamEvent",
    "ErrorResponse",
    "CreateCompletionRequest",
    "CreateChatCompletionRequest",
    "CreateResponse",
    "CreateEmbeddingRequest",
)


def refs_in(node: Any) -> set[str]:
    """The component names a schema fragment references, directly."""
    if isinstance(node, dict):
        found = set()
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith(PREFIX):
                found.add(value[len(PREFIX) :])
            else:
                found |= refs_in(value)
        return found
    if isinstance(node, list):
        return set().union(*map(refs_in, node)) if node else set()
    return set()


def closure(schemas: dict[str, Any], roots: tuple[str, ...]) -> dict[str, Any]:
    keep: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        todo.extend(refs_in(schemas[name]) - keep.keys())
    return dict(sorted(keep.items()))


def load(path: Path) -> dict[str, Any]:
    if path.suffix in (".yaml", ".yml"):
        import yaml  # only for the YAML form of the document

        return yaml.safe_load(path.read_text())
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("document", type=Path, help="openapi.yaml or openapi.json")
    parser.add_argument("--commit", default="", help="the openai-openapi commit it came from")
    args = parser.parse_args()
    doc = load(args.document)
    subset = {
        "x-source": {
            "repository": "https://github.com/openai/openai-openapi",
            "commit": args.commit,
            "version": doc["info"]["version"],
            "license": "MIT, Copyright (c) OpenAI; see README.md in this folder",
            "roots": list(ROOTS),
        },
        "components": {"schemas": closure(doc["components"]["schemas"], ROOTS)},
    }
    OUT.write_text(json.dumps(subset, indent=1, sort_keys=False) + "\n")
    print(f"{OUT}: {len(subset['components']['schemas'])} schemas")


if __name__ == "__main__":
    main()
