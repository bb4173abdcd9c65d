"""Chat: the templates a conversation is rendered through, and `verispec chat`.

- `template`: `ChatTemplate`, HF's jinja2 dialect with HF's variables; `render_marked` says where each
  message's content lies (so user text never becomes control tokens); defaults for GGUFs without one.
- `sandbox`: the bounded jinja2 sandbox templates render in (time and output-size limits);
  `ChatTemplateError`.
- `bounds`: the size checks the sandbox and its filters run before building a value
  (RENDER_MAX_CHARS characters, RENDER_MAX_ITEMS items).
- `filters`: jinja2's filters, bounded (`bound_filters`), each checked before and after it runs.
- `repl`: `verispec chat`, an interactive conversation on stdin, one user turn per line (`run_chat`).

`verispec.tokenizer` renders through `template`; the engine, the server and `repl` reach it through the tokenizer.
"""
