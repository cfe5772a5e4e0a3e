#include "tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"

namespace kvmem::worker {
namespace {

// Decodes one UTF-8 code point at text[i]; malformed bytes decode as U+FFFD, one byte long.
uint32_t NextCodePoint(absl::string_view text, size_t i, size_t* len) {
  const auto b = static_cast<uint8_t>(text[i]);
  auto cont = [&](size_t k) {
    return i + k < text.size() && (static_cast<uint8_t>(text[i + k]) & 0xc0) == 0x80;
  };
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  if ((b & 0xe0) == 0xc0 && cont(1)) {
    *len = 2;
    return ((b & 0x1fu) << 6) | (text[i + 1] & 0x3f);
  }
  if ((b & 0xf0) == 0xe0 && cont(1) && cont(2)) {
    *len = 3;
    return ((b & 0x0fu) << 12) | ((text[i + 1] & 0x3fu) << 6) | (text[i + 2] & 0x3f);
  }
  if ((b & 0xf8) == 0xf0 && cont(1) && cont(2) && cont(3)) {
    *len = 4;
    return ((b & 0x07u) << 18) | ((text[i + 1] & 0x3fu) << 12) | ((text[i + 2] & 0x3fu) << 6) |
           (text[i + 3] & 0x3f);
  }
  *len = 1;
  return 0xfffd;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

bool IsLetter(uint32_t cp) { return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_L_MASK) != 0; }
bool IsNumber(uint32_t cp) { return (U_GET_GC_MASK(static_cast<UChar32>(cp)) & U_GC_N_MASK) != 0; }
bool IsSpace(uint32_t cp) { return u_isUWhiteSpace(static_cast<UChar32>(cp)) != 0; }

struct Cp {
  uint32_t cp;
  size_t offset;  // byte offset in the piece
};

std::vector<Cp> CodePoints(absl::string_view text) {
  std::vector<Cp> cps;
  for (size_t i = 0; i < text.size();) {
    size_t len;
    const uint32_t cp = NextCodePoint(text, i, &len);
    cps.push_back({cp, i});
    i += len;
  }
  return cps;
}

// The GPT-2 split of one run:
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void Gpt2Split(absl::string_view text, std::vector<std::string>* out) {
  const std::vector<Cp> cps = CodePoints(text);
  const size_t n = cps.size();
  auto at = [&](size_t i) -> uint32_t { return i < n ? cps[i].cp : UINT32_MAX; };
  auto byte_at = [&](size_t i) { return i < n ? cps[i].offset : text.size(); };
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    const uint32_t c = at(i);
    if (c == '\'' && i + 1 < n) {
      const uint32_t c1 = at(i + 1);
      const uint32_t c2 = at(i + 2);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        end = i + 2;
      } else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
        end = i + 3;
      }
    }
    if (end == i) {
      const size_t j = (c == ' ') ? i + 1 : i;  // the optional leading space
      const uint32_t d = at(j);
      if (j < n && IsLetter(d)) {
        end = j;
        while (end < n && IsLetter(at(end))) ++end;
      } else if (j < n && IsNumber(d)) {
        end = j;
        while (end < n && IsNumber(at(end))) ++end;
      } else if (j < n && !IsSpace(d) && !IsLetter(d) && !IsNumber(d)) {
        end = j;
        while (end < n && !IsSpace(at(end)) && !IsLetter(at(end)) && !IsNumber(at(end))) ++end;
      } else if (IsSpace(c)) {
        end = i;
        while (end < n && IsSpace(at(end))) ++end;
        // \s+(?!\S): leave the last space for the next token when one follows.
        if (end < n && end - i > 1) --end;
      } else {
        end = i + 1;
      }
    }
    out->emplace_back(text.substr(byte_at(i), byte_at(end) - byte_at(i)));
    i = end;
  }
}

}  // namespace

std::vector<std::string> Tokenizer::PreTokenize(absl::string_view text) {
  // "smollm": \p{N} alone first, then the GPT-2 split of every other run.
  std::vector<std::string> pieces;
  const std::vector<Cp> cps = CodePoints(text);
  size_t run_start = 0;
  for (size_t i = 0; i <= cps.size(); ++i) {
    const bool boundary = i == cps.size() || IsNumber(cps[i].cp);
    if (!boundary) continue;
    const size_t begin = run_start < cps.size() ? cps[run_start].offset : text.size();
    const size_t end = i < cps.size() ? cps[i].offset : text.size();
    if (end > begin) Gpt2Split(text.substr(begin, end - begin), &pieces);
    if (i < cps.size()) {
      const size_t next = i + 1 < cps.size() ? cps[i + 1].offset : text.size();
      pieces.emplace_back(text.substr(cps[i].offset, next - cps[i].offset));
    }
    run_start = i + 1;
  }
  return pieces;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
  absl::StatusOr<std::string> model = file.GetString("tokenizer.ggml.model");
  if (!model.ok()) return model.status();
  if (*model != "gpt2") {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer: model \"", *model, "\" is not supported (gpt2 only)"));
  }
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  absl::StatusOr<std::vector<std::string>> tokens = file.GetStrings("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.status();
  absl::StatusOr<std::vector<std::string>> merges = file.GetStrings("tokenizer.ggml.merges");
  if (!merges.ok()) return merges.status();
  absl::StatusOr<std::vector<int64_t>> types = file.GetInts("tokenizer.ggml.token_type");
  if (!types.ok()) return types.status();
  if (types->size() != tokens->size()) {
    return absl::DataLossError("tokenizer: token_type and tokens differ in length");
  }
  t->tokens_ = *std::move(tokens);
  t->special_.resize(t->tokens_.size());
  for (size_t i = 0; i < t->tokens_.size(); ++i) {
    t->ids_.emplace(t->tokens_[i], static_cast<int32_t>(i));
    // 3 = control, 4 = user-defined: matched literally when parsing specials.
    if ((*types)[i] == 3 || (*types)[i] == 4) {
      t->special_[i] = true;
      t->specials_.emplace_back(t->tokens_[i], static_cast<int32_t>(i));
    }
  }
  std::stable_sort(t->specials_.begin(), t->specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (size_t r = 0; r < merges->size(); ++r)
    t->merge_rank_.emplace((*merges)[r], static_cast<int32_t>(r));
  // GPT-2 bytes_to_unicode: printable bytes stand for themselves, the rest map to 256 + k.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    std::string symbol;
    AppendUtf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++), &symbol);
    t->byte_to_symbol_[b] = symbol;
    t->symbol_to_byte_.emplace(symbol, static_cast<uint8_t>(b));
  }
  if (absl::StatusOr<int64_t> eos = file.GetInt("tokenizer.ggml.eos_token_id"); eos.ok()) {
    t->eos_ = static_cast<int32_t>(*eos);
  }
  if (auto it = t->ids_.find("<|im_end|>"); it != t->ids_.end()) t->im_end_ = it->second;
  t->default_system_ = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
  return t;
}

void Tokenizer::EncodePiece(absl::string_view piece, std::vector<int32_t>* out) const {
  std::vector<std::string> symbols;
  symbols.reserve(piece.size());
  for (unsigned char b : piece) symbols.push_back(byte_to_symbol_[b]);
  // Merge the lowest-ranked adjacent pair until none is in the merge list.
  while (symbols.size() > 1) {
    int best_rank = INT_MAX;
    size_t best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merge_rank_.find(absl::StrCat(symbols[i], " ", symbols[i + 1]));
      if (it != merge_rank_.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank == INT_MAX) break;
    symbols[best] += symbols[best + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  for (const std::string& s : symbols) {
    auto it = ids_.find(s);
    if (it != ids_.end()) {
      out->push_back(it->second);
      continue;
    }
    // Not in the vocabulary: fall back to its single-byte symbols.
    for (size_t i = 0; i < s.size();) {
      size_t len;
      NextCodePoint(s, i, &len);
      auto byte = ids_.find(s.substr(i, len));
      if (byte != ids_.end()) out->push_back(byte->second);
      i += len;
    }
  }
}

std::vector<int32_t> Tokenizer::Encode(absl::string_view text, bool parse_special) const {
  std::vector<int32_t> ids;
  size_t start = 0;
  auto encode_text = [&](absl::string_view part) {
    for (const std::string& piece : PreTokenize(part)) EncodePiece(piece, &ids);
  };
  if (parse_special) {
    for (size_t i = 0; i < text.size();) {
      bool matched = false;
      for (const auto& [str, id] : specials_) {
        if (!str.empty() && text.substr(i, str.size()) == str) {
          encode_text(text.substr(start, i - start));
          ids.push_back(id);
          i += str.size();
          start = i;
          matched = true;
          break;
        }
      }
      if (!matched) ++i;
    }
  }
  encode_text(text.substr(start));
  return ids;
}

std::string Tokenizer::Decode(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= tokens_.size()) return "";
  const std::string& token = tokens_[id];
  if (special_[id]) return token;
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    size_t len;
    NextCodePoint(token, i, &len);
    auto it = symbol_to_byte_.find(token.substr(i, len));
    if (it != symbol_to_byte_.end()) {
      bytes.push_back(static_cast<char>(it->second));
    } else {
      bytes.append(token, i, len);
    }
    i += len;
  }
  return bytes;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += Decode(id);
  return out;
}

std::string Tokenizer::ChatPrompt(absl::string_view user, absl::string_view system) const {
  return absl::StrCat("<|im_start|>system\n", system.empty() ? default_system_ : system,
                      "<|im_end|>\n<|im_start|>user\n", user,
                      "<|im_end|>\n<|im_start|>assistant\n");
}

}  // namespace kvmem::worker
