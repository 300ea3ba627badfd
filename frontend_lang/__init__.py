"""frontend_lang: SGLang's frontend language for multi-call LLM programs, on radixrt.

An SGLang program runs after changing its import to ``import frontend_lang as sgl``::

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    state = qa.run(question="What is a radix tree?")
    print(state["answer"])
"""

from __future__ import annotations

from frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    var_scope,
    video,
)
from frontend_lang.backends import (
    BackendError,
    BaseBackend,
    ConstraintsNotSupportedError,
    EngineBackend,
    OpenAI,
    Runtime,
    RuntimeEndpoint,
)
from frontend_lang.chat_template import get_chat_template
from frontend_lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend_lang.errors import NestedRoleError, ProgramError
from frontend_lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from frontend_lang.program import Program, global_config
from frontend_lang.state import ProgramState, ProgramStateGroup
from frontend_lang.tools import ToolCall, tool, tools_prompt
from frontend_lang.tracer import ProgramGraph

__all__ = [
    "BackendError",
    "BaseBackend",
    "ChoicesMethod",
    "ConstraintsNotSupportedError",
    "EngineBackend",
    "NestedRoleError",
    "OpenAI",
    "Program",
    "ProgramError",
    "ProgramGraph",
    "ProgramState",
    "ProgramStateGroup",
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Runtime",
    "RuntimeEndpoint",
    "ToolCall",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "tool",
    "tools_prompt",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "var_scope",
    "video",
]
