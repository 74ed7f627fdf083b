// llama.cpp's chat code (common/chat.cpp) with C linkage: its own rendering of a request's
// messages, and the parser it derives from the template to split an answer into reasoning and
// content, as llama-server does. Everything crosses as JSON text; no C++ exception may leave.
#include "dflash2_shim.h"

#include "chat.h"
#include "json.h"
#include "log.h"
#include "reasoning-budget.h"

#include <cstdlib>
#include <cstring>
#include <string>

struct dflash2_chat {
    common_chat_templates_ptr tmpls;
};

struct dflash2_chat_parser {
    common_chat_parser_params params;
};

namespace {

char * copy_out(const std::string & s) {
    char * out = (char *) std::malloc(s.size() + 1);
    if (out != nullptr) {
        std::memcpy(out, s.data(), s.size());
        out[s.size()] = '\0';
    }
    return out;
}

void set_error(char ** error, const char * what) {
    if (error != nullptr) {
        *error = copy_out(what);
    }
}

} // namespace

extern "C" {

dflash2_chat * dflash2_chat_new(const llama_model * model, const char * tmpl, char ** error) {
    try {
        // common's logger prints straight to the terminal; dflash2 logs through tracing.
        common_log_pause(common_log_main());
        auto * chat = new dflash2_chat();
        chat->tmpls = common_chat_templates_init(model, tmpl);
        return chat;
    } catch (const std::exception & e) {
        set_error(error, e.what());
        return nullptr;
    } catch (...) {
        set_error(error, "llama.cpp could not read the chat template");
        return nullptr;
    }
}

void dflash2_chat_free(dflash2_chat * chat) {
    delete chat;
}

dflash2_chat_parser * dflash2_chat_apply(const dflash2_chat * chat, const char * messages_json, const char * kwargs_json,
                                         bool add_generation_prompt, bool enable_thinking,
                                         const char * reasoning_format, char ** info, char ** error) {
    try {
        common_chat_templates_inputs inputs;
        inputs.messages              = common_chat_msgs_parse_oaicompat(common_json::parse(messages_json));
        inputs.add_generation_prompt = add_generation_prompt;
        inputs.enable_thinking       = enable_thinking;
        inputs.reasoning_format      = common_reasoning_format_from_name(reasoning_format);
        const auto kwargs            = common_json::parse(kwargs_json);
        for (auto it = kwargs.begin(); it != kwargs.end(); ++it) {
            inputs.chat_template_kwargs[it.key()] = it.value().dump();
        }
        const common_chat_params params = common_chat_templates_apply(chat->tmpls.get(), inputs);

        auto * parser                    = new dflash2_chat_parser();
        parser->params                   = common_chat_parser_params(params);
        parser->params.reasoning_format  = inputs.reasoning_format;
        parser->params.parse_tool_calls  = false; // dflash2 parses tool calls itself (server/tools.rs)
        if (!params.parser.empty()) {
            parser->params.parser.load(params.parser);
        }
        common_json out = common_json::object();
        out["prompt"]             = params.prompt;
        out["generation_prompt"]  = params.generation_prompt;
        out["supports_thinking"]  = params.supports_thinking;
        out["thinking_start_tag"] = params.thinking_start_tag;
        out["thinking_end_tags"]  = params.thinking_end_tags;
        out["preserved_tokens"]   = params.preserved_tokens;
        *info = copy_out(out.dump_safe());
        return parser;
    } catch (const std::exception & e) {
        set_error(error, e.what());
        return nullptr;
    } catch (...) {
        set_error(error, "llama.cpp could not render the chat");
        return nullptr;
    }
}

void dflash2_chat_parser_free(dflash2_chat_parser * parser) {
    delete parser;
}

char * dflash2_chat_parse(const dflash2_chat_parser * parser, const char * text, size_t len, bool partial, char ** error) {
    try {
        const common_chat_msg msg = common_chat_parse(std::string(text, len), partial, parser->params);
        common_json out           = common_json::object();
        out["content"]            = msg.content;
        out["reasoning_content"]  = msg.reasoning_content;
        return copy_out(out.dump_safe());
    } catch (const std::exception & e) {
        set_error(error, e.what());
        return nullptr;
    } catch (...) {
        set_error(error, "llama.cpp could not parse the answer");
        return nullptr;
    }
}

llama_sampler * dflash2_reasoning_budget(const llama_vocab * vocab, const llama_token * start, size_t n_start,
                                         const llama_token * end, size_t n_end, const llama_token * forced,
                                         size_t n_forced, int32_t budget, bool open) {
    try {
        return common_reasoning_budget_init(vocab, { llama_tokens(start, start + n_start) }, { llama_tokens(end, end + n_end) },
                                            llama_tokens(forced, forced + n_forced), budget,
                                            open ? REASONING_BUDGET_COUNTING : REASONING_BUDGET_IDLE);
    } catch (...) {
        return nullptr;
    }
}

void dflash2_string_free(char * s) {
    std::free(s);
}

} // extern "C"
