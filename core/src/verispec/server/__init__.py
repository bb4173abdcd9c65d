"""OpenAI-compatible HTTP server over one InferenceEngine (FastAPI): `verispec serve`.

  GET  /                      the chat page (verispec.server.page): streams turns from
                              /v1/chat/completions, shows each answer's `verispec` numbers
  POST /v1/completions        `prompt`: text or token ids
  POST /v1/chat/completions   `messages`, rendered through the model's chat template
  GET  /v1/models             the one loaded model
  GET  /health                {"status": "ok", "speculator": name | null}
  GET  /metrics               Prometheus text: requests running/waiting, tokens generated,
                              drafted/accepted tokens, prefix-cache hits, the KV budget
                              (budget, reserved and idle bytes), requests by speculation reason

Many clients at once: a handler queues its request in the engine's scheduler (continuous
batching: verispec.scheduler) and awaits its events; one engine thread steps the scheduler
while requests run or wait, so every running request advances in each step's one forward,
and the event loop (/health, /metrics, new requests) never waits on the model. A client that
leaves — mid-stream, or while waiting for a whole response — cancels its request: it leaves
the batch at the next step and its sequence is freed (a request abandoned while queued never
runs). A generation that runs longer than `request_timeout` seconds (`verispec serve
--request-timeout`, default 600; queueing time not counted) ends at that token with
finish_reason "length", as if max_tokens had been reached, even while a speculator call hangs
(verispec.plugin_calls: the call is abandoned and the speculator switched off). An engine
error fails the requests of that step (HTTP 500), never the server, except a lost tensor-parallel rank
(`verispec serve --tp N`; verispec.tensor_parallel.RankLost): the model cannot run again, so
its requests answer 503 (mid-stream: a last `data: {"error": ...}` event) naming the rank, and
the server shuts down, `verispec serve` exiting with status 1 and that message (a supervisor
then restarts the whole group). Tokenising a prompt (and rendering the
chat template) runs in a worker thread, never on the event loop. Shutting down (Ctrl-C,
SIGTERM: see `server()`) ends every running or waiting generation at its next token
(finish_reason "length"), so the server exits at once, its responses complete.
Speculation is the server's policy (the --spec* flags of `verispec serve`); a request can only
turn it off for itself (`"verispec": {"speculation": false}`; same output). An API key
(VERISPEC_API_KEY, `--api-key`; verispec.server.auth) makes /v1/* require `Authorization: Bearer
KEY`; without one, `serve` on a host other than loopback warns that anyone who reaches the port
can run the model. Under `serve` / `server()` (verispec.server.connection) a Host header that is
not an IP address, localhost or an `--allowed-host` name answers 421 (DNS rebinding), and a
connection whose headers are not whole within DEFAULT_HEADER_TIMEOUT seconds is closed; FastAPI's
/docs and /redoc are off unless create_app(docs=True) (`serve --docs`).

Request fields, as OpenAI's API: max_tokens (completions: 16 by default, as OpenAI; chat:
until a stop or a full context; `max_completion_tokens` is its newer name; a value larger
than the context leaves after the prompt is a 400 naming that limit, as OpenAI answers),
temperature
(1 by default, as OpenAI; 0 is greedy), top_p, seed, stop (a string or a list),
frequency_penalty, presence_penalty, logprobs (completions: N; chat: true + top_logprobs N),
stream, stream_options.include_usage. Extensions, spelled as vLLM does: top_k, min_p,
repetition_penalty, ignore_eos. `model` is accepted and ignored: one model is loaded.
Fields that would change the output but are not supported (n > 1, best_of, echo, suffix,
logit_bias, tools, a non-text response_format) answer 400, never a silent ignore.

Responses carry `usage` (prompt_tokens, completion_tokens, total_tokens), the engine's
finish_reason ("stop" | "length"), and an extension object `verispec` (reused prefix, queued_ms,
time to first token, decode tok/s, speculator, drafted/accepted tokens, governor line, and
`reason`: why it speculated or not, {"code", "text"} from verispec.reasons). Logprobs are the
engine's processed logprobs (verispec.sampling); a token's text is its own decoding.

Errors: a request the engine or the sampler rejects (a prompt longer than the context, a
sampling value out of range, no chat template, malformed JSON, a prompt, message or stop
string holding a lone surrogate such as "\\ud800", which is not Unicode text, a message role
other than system, developer, user, assistant, tool, a non-assistant message without content,
a text content part whose `text` is not a string)
answers HTTP 400 with OpenAI's error body {"error": {"message", "type", "param", "code"}}; the
message says the fix and `param` names the field (e.g. "messages[1].content", "temperature"). A
body larger than `max_body_bytes` (8 MiB by default) answers 413, naming the limit; one still
incomplete `body_timeout` seconds (30 by default) after its headers answers 408; both close the
connection. A model's chat template that fails (a syntax error, a sandbox refusal, a render
bound) answers 500 naming the template error (type "server_error"); its raise_exception refusing
the messages answers 400. A bug answers 500 with the same body shape (type "server_error").

Streaming is Server-Sent Events: one `data: {chunk}` per token the engine emits (its text
may be "" while a split character or a possible stop string is held back), then a chunk
carrying finish_reason and `verispec`, then, with include_usage, a chunk carrying usage and
`verispec`, then `data: [DONE]`. The chunks' texts concatenate to the non-streamed text.

Modules: `protocol` (request bodies, limits, the error body), `app` (routes, the request
lifecycle, `serve`), `body_limit` (the body-read middleware), `metrics` (/metrics' text), `auth`
(the API key), `connection` (the Host check, the header timeout, the port check), `engine_thread`
(the thread that steps the engine), `responses` (completion/chat bodies, stream chunks), `page`
(the chat page; its files in static/).
"""
from verispec.server.app import create_app, exposure_warning, serve, server
from verispec.server.metrics import prometheus_text
from verispec.server.protocol import RequestRejected

__all__ = ["RequestRejected", "create_app", "exposure_warning", "prometheus_text", "serve", "server"]
