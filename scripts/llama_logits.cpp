// Teacher-forced logits of llama.cpp for given token ids: every position of every sequence.
//
//   llama-logits MODEL.gguf IDS.txt OUT.npy [--threads N] [--kv f16|f32] [--flash-attn auto|on|off]
//
// IDS.txt holds one sequence per line, token ids separated by spaces; the ids are decoded as
// given (no BOS is added: that happens only when text is tokenized). Each sequence is decoded
// in one llama_decode call on a cleared cache, with an output requested at every position, and
// OUT.npy receives a float32 matrix [sum of the lengths, n_vocab]: the rows of the sequences one
// after the other, row i of a sequence predicting its token i + 1. Built by `make parity-llama`
// against the static libraries of .peers/build.

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Warnings and errors only, unless LLAMA_LOGITS_VERBOSE is set.
void quiet_log(enum ggml_log_level level, const char * text, void *) {
    static const bool verbose = std::getenv("LLAMA_LOGITS_VERBOSE") != nullptr;
    if (verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

int fail(const std::string & message) {
    std::fprintf(stderr, "llama-logits: %s\n", message.c_str());
    return 1;
}

std::vector<std::vector<llama_token>> read_sequences(const char * path) {
    std::vector<std::vector<llama_token>> sequences;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream fields(line);
        std::vector<llama_token> ids;
        long id;
        while (fields >> id) {
            ids.push_back(static_cast<llama_token>(id));
        }
        if (!ids.empty()) {
            sequences.push_back(std::move(ids));
        }
    }
    return sequences;
}

// A version 1.0 .npy header for a C-order little-endian float32 matrix, padded so that the data
// starts at a multiple of 64 bytes.
void write_npy_header(std::FILE * out, size_t rows, size_t cols) {
    std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
    const size_t preamble = 10;  // magic (6) + version (2) + header length (2)
    size_t total = preamble + dict.size() + 1;
    size_t padded = (total + 63) / 64 * 64;
    dict.append(padded - total, ' ');
    dict.push_back('\n');
    const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    std::fwrite(magic, 1, sizeof magic, out);
    const uint16_t length = static_cast<uint16_t>(dict.size());
    const unsigned char length_le[2] = {static_cast<unsigned char>(length & 0xff), static_cast<unsigned char>(length >> 8)};
    std::fwrite(length_le, 1, 2, out);
    std::fwrite(dict.data(), 1, dict.size(), out);
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 4) {
        return fail("usage: llama-logits MODEL.gguf IDS.txt OUT.npy [--threads N] [--kv f16|f32] [--flash-attn auto|on|off]");
    }
    const char * model_path = argv[1];
    const char * ids_path = argv[2];
    const char * out_path = argv[3];
    int threads = 2;
    ggml_type kv_type = GGML_TYPE_F16;
    llama_flash_attn_type flash = LLAMA_FLASH_ATTN_TYPE_AUTO;
    for (int i = 4; i < argc; ++i) {
        const std::string flag = argv[i];
        if (i + 1 >= argc) {
            return fail("missing value after " + flag);
        }
        const std::string value = argv[++i];
        if (flag == "--threads") {
            threads = std::atoi(value.c_str());
        } else if (flag == "--kv" && (value == "f16" || value == "f32")) {
            kv_type = value == "f16" ? GGML_TYPE_F16 : GGML_TYPE_F32;
        } else if (flag == "--flash-attn" && (value == "auto" || value == "on" || value == "off")) {
            flash = value == "auto" ? LLAMA_FLASH_ATTN_TYPE_AUTO
                    : value == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                                    : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        } else {
            return fail("bad option " + flag + " " + value);
        }
    }

    const auto sequences = read_sequences(ids_path);
    if (sequences.empty()) {
        return fail(std::string("no token ids in ") + ids_path);
    }
    size_t longest = 0, rows = 0;
    for (const auto & ids : sequences) {
        longest = ids.size() > longest ? ids.size() : longest;
        rows += ids.size();
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, model_params);
    if (model == nullptr) {
        return fail(std::string("cannot load ") + model_path);
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);

    // One ubatch holds a whole sequence, as pagedkv prefills it whole.
    llama_context_params ctx_params = llama_context_default_params();
    ctx_params.n_ctx = static_cast<uint32_t>(longest);
    ctx_params.n_batch = static_cast<uint32_t>(longest);
    ctx_params.n_ubatch = static_cast<uint32_t>(longest);
    ctx_params.n_seq_max = 1;
    ctx_params.n_threads = threads;
    ctx_params.n_threads_batch = threads;
    ctx_params.type_k = kv_type;
    ctx_params.type_v = kv_type;
    ctx_params.flash_attn_type = flash;
    ctx_params.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, ctx_params);
    if (ctx == nullptr) {
        llama_model_free(model);
        return fail("cannot create a context");
    }
    std::fprintf(stderr, "llama-logits: %zu sequences, %zu rows, vocab %d, threads %d, kv %s, flash attention %s, n_ctx %u\n",
                 sequences.size(), rows, n_vocab, threads, kv_type == GGML_TYPE_F16 ? "f16" : "f32",
                 llama_flash_attn_type_name(flash), llama_n_ctx(ctx));

    std::FILE * out = std::fopen(out_path, "wb");
    if (out == nullptr) {
        return fail(std::string("cannot write ") + out_path);
    }
    write_npy_header(out, rows, static_cast<size_t>(n_vocab));

    llama_batch batch = llama_batch_init(static_cast<int32_t>(longest), 0, 1);
    int status = 0;
    for (const auto & ids : sequences) {
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = static_cast<int32_t>(ids.size());
        for (size_t i = 0; i < ids.size(); ++i) {
            batch.token[i] = ids[i];
            batch.pos[i] = static_cast<llama_pos>(i);
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        const int32_t rc = llama_decode(ctx, batch);
        if (rc != 0) {
            status = fail("llama_decode returned " + std::to_string(rc));
            break;
        }
        for (size_t i = 0; i < ids.size(); ++i) {
            const float * row = llama_get_logits_ith(ctx, static_cast<int32_t>(i));
            if (row == nullptr) {
                status = fail("no logits at position " + std::to_string(i));
                break;
            }
            std::fwrite(row, sizeof(float), static_cast<size_t>(n_vocab), out);
        }
        if (status != 0) {
            break;
        }
    }
    llama_batch_free(batch);
    if (std::fclose(out) != 0 && status == 0) {
        status = fail(std::string("cannot finish ") + out_path);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return status;
}
