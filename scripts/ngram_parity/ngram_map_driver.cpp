// Drives llama.cpp's own n-gram map drafter (common/ngram-map.cpp) over
// scripted steps, so specd's port can be checked against it token for token.
// Built and run by scripts/ngram_parity/ngram_parity.py; not part of specd.
//
// argv: size_n size_m key_only(0|1) min_hits
// stdin, one command a line, tokens as decimal ids:
//   B n t0 .. tn-1           common_ngram_map_begin(tokens)
//   D n t0 .. tn-1 sampled   common_ngram_map_draft(tokens, sampled) -> prints the draft
//   A k                      common_ngram_map_accept(k)
// stdout: one line a D command: the draft's length, then its tokens.
#include "ngram-map.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

static llama_tokens read_tokens(std::istream & in) {
    size_t n = 0;
    in >> n;
    llama_tokens t(n);
    for (size_t i = 0; i < n; ++i) {
        in >> t[i];
    }
    return t;
}

int main(int argc, char ** argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s size_n size_m key_only min_hits < commands\n", argv[0]);
        return 2;
    }
    common_ngram_map map((uint16_t) std::atoi(argv[1]), (uint16_t) std::atoi(argv[2]),
                         std::atoi(argv[3]) != 0, (uint16_t) std::atoi(argv[4]));
    std::string cmd;
    while (std::cin >> cmd) {
        if (cmd == "B") {
            common_ngram_map_begin(map, read_tokens(std::cin));
        } else if (cmd == "D") {
            llama_tokens inp = read_tokens(std::cin);
            llama_token sampled = 0;
            std::cin >> sampled;
            llama_tokens draft;
            common_ngram_map_draft(map, inp, sampled, draft);
            std::printf("%zu", draft.size());
            for (llama_token t : draft) {
                std::printf(" %d", t);
            }
            std::printf("\n");
        } else if (cmd == "A") {
            int k = 0;
            std::cin >> k;
            common_ngram_map_accept(map, (uint16_t) k);
        } else {
            std::fprintf(stderr, "unknown command %s\n", cmd.c_str());
            return 2;
        }
    }
    return 0;
}
