"""vLLM's tokenizer routes, which lm-evaluation-harness's remote tokenizer (tokenizer_backend=remote) and other
clients use to count and cut prompts exactly as the server does:

    POST /tokenize {"prompt": str, "add_special_tokens"?, "model"?} -> {"tokens": [...], "count": n, "max_model_len": N}
    POST /detokenize {"tokens": [...], "model"?}                     -> {"prompt": str}
    GET /tokenizer_info                                              -> special tokens, chat template, model_max_length

At the server's root, as in vLLM; with an API key they need it, as the /v1/ routes do.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from serving.auth import API, require_json
from serving.model import ServedModel
from serving.protocol.tokenize import DetokenizeBody, TokenizeBody, TokenizerBody
from serving.protocol.validate import validate_body
from serving.request import read_json

router = APIRouter(dependencies=API)


async def open_tokenizer_request(request: Request, model: type[TokenizerBody]):
    served: ServedModel = request.app.state.served
    body = validate_body(model, await read_json(request, served.max_body_bytes))
    if body.model is not None:
        served.check_model(body.model)
    return served, body


@router.post("/tokenize", dependencies=[Depends(require_json)])
async def tokenize(request: Request) -> dict:
    served, body = await open_tokenizer_request(request, TokenizeBody)
    served.check_length([body.prompt], "prompt")  # a text that cannot fit the context is not tokenized
    ids = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
    return {"tokens": ids, "count": len(ids), "max_model_len": served.context, "token_strs": None}


@router.post("/detokenize", dependencies=[Depends(require_json)])
async def detokenize(request: Request) -> dict:
    served, body = await open_tokenizer_request(request, DetokenizeBody)
    served.check_ids(body.tokens, "tokens")
    return {"prompt": served.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    return request.app.state.served.tokenizer_info()
