#pragma once
// Tokenizer: GPT-2 style byte-level BPE as stored in a GGUF file (tokenizer.ggml.*), with
// the pre-tokenizer SmolLM uses ("smollm": every digit alone, then the GPT-2 split) and
// special tokens (<|im_start|>, ...) matched literally when asked to.
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gguf.h"

namespace kvmem::worker {

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);

  // Token ids of `text` (UTF-8). With parse_special, special-token strings in the text become
  // their ids; otherwise they are ordinary text.
  std::vector<int32_t> Encode(absl::string_view text, bool parse_special) const;
  // The bytes a token stands for (special tokens: their text).
  std::string Decode(int32_t id) const;
  std::string Decode(const std::vector<int32_t>& ids) const;

  // The instruct chat format: a system turn (the model's default when empty), a user turn,
  // and the opening of the assistant turn.
  std::string ChatPrompt(absl::string_view user, absl::string_view system = "") const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t eos() const { return eos_; }
  int32_t im_end() const { return im_end_; }
  bool IsSpecial(int32_t id) const { return special_[id]; }

  // Pre-tokenization alone (exposed for tests): byte ranges of the pieces BPE sees.
  static std::vector<std::string> PreTokenize(absl::string_view text);

 private:
  Tokenizer() = default;
  void EncodePiece(absl::string_view piece, std::vector<int32_t>* out) const;

  std::vector<std::string> tokens_;  // byte-level unicode form
  std::vector<bool> special_;
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<std::string, int32_t> merge_rank_;    // "left right" -> rank
  std::vector<std::pair<std::string, int32_t>> specials_;  // text -> id, longest first
  std::string byte_to_symbol_[256];
  std::unordered_map<std::string, uint8_t> symbol_to_byte_;
  int32_t eos_ = -1;
  int32_t im_end_ = -1;
  std::string default_system_;
};

}  // namespace kvmem::worker
