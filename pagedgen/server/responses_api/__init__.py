"""OpenAI's Responses API (``/v1/responses``), served as a translation onto the chat-completions route.

``wire`` holds the request's pydantic models, ``convert`` turns a request (and the stored conversation its
``previous_response_id`` names) into a chat-completions request, ``output`` turns that route's chat payloads
into Responses objects and stream events, ``store`` keeps finished responses for follow-ups and ``GET``,
and ``route`` wires them to the chat route's admission, sampling, errors and streaming.
(:mod:`pagedgen.server.responses` is something else: the chat and completions payload builders.)
"""
