"""Structured outputs: output constrained to a JSON schema, a regex, a list of choices or a
grammar, and the OpenAI tool calls built on them. `spec` says what a request asks for,
`backend` compiles it with the grammar library behind one small interface, `tools` renders and
parses tool calls, `nested_schema` keeps a tool schema's references resolving once it is nested
in the schema of a call."""
