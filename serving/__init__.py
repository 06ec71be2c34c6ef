"""The HTTP layer of `astrai serve`: OpenAI- and Anthropic-compatible routes over astrai_core's engine.

    app = create_app(engine, chat, model_id="astrai/3", api_key=None)    # serving.app; engine: an EngineClient
    status = run(app, engine, "127.0.0.1", 8000)                          # serving.server
    # `astrai serve` (astrai/cli.py) parses its options, resolves the model, then: serving.auth, serving.launch

    protocol/       the request bodies (pydantic): base.py (fields and validators both protocols share),
                    openai.py, anthropic.py; validate.py (a parsed body to its model: Unicode, then pydantic,
                    400 naming the field)
    errors.py       ApiError, rendered in the shape of the protocol a route speaks; the app's exception handlers
    auth.py         who may call (route dependencies): the API key, the Host and Origin a request names (pages of
                    other sites are refused: 403), JSON bodies only (415); and who must have a key (check_exposure:
                    a --host other machines reach needs --api-key or --insecure; loopback detection)
    request.py      a route's opening: read the JSON body (413, 400), validate it, check the model (404)
    model.py        ServedModel: the served model as the routes share it (names, prompt ids, submission), kept
                    on app.state
    text_stream.py  TextStream: token ids to the text that can no longer change
    streaming.py    a request in the engine (Submission, EventRelay), its events as text pieces (run_generation),
                    server-sent events (sse, EventStream), a whole reply (collect); client disconnects
    metrics.py      the Prometheus registry: the engine's gauges and counters, time to first token
    openai.py       POST /v1/chat/completions, POST /v1/completions
    anthropic.py    POST /v1/messages
    app.py          create_app: the routers, the error handlers, GET / (the chat page in static/), /health,
                    /metrics, /v1/models
    server.py       run: the app on uvicorn while the engine lives; an engine that died ends the server with
                    status 1, for a supervisor to restart it
    launch.py       what `astrai serve` runs once its options are parsed and its model resolved: the port's
                    check, the engine (load_engine: in a process of its own or a thread), then the app, the
                    start-up line, the registry alias's watch (model.py AliasWatch) and its polling, and run (serve)

A request's way through: its Host, Origin, key and Content-Type are checked (auth.py), the JSON body is read
(413 past the size limit), parsed and validated by the pydantic models of its protocol (400 naming the field;
strict types, messages and content parts bounded by count, no control-token text in any message), turned into
prompt token ids (the chat template for chat and messages), and submitted to the engine with a callback that
hands each event (new token ids, finish reason) from the engine's thread to this request's asyncio queue
(EventRelay: one wake-up of the event loop per engine step). TextStream turns the token ids into text: it gives
out only text that can no longer change, so a stop string is never returned, not even partly, and a character
whose UTF-8 bytes are split across tokens is held back until it is whole. Responses and errors take each
protocol's own shape. A client that goes away (a closed stream or an abandoned request) has its engine request
cancelled, which frees its batch slot and KV blocks at the engine's next step.

The engine knows nothing of HTTP; this package uses only its interface, astrai_core.inference.engine.EngineClient (submit,
cancel, stats, alive, after_step, context_length), which Engine and EngineProcess both implement.
"""
