#pragma once
// What an error message may echo of a string a client sent. A status message travels in a
// header; echoing a 200 KB name whole turns INVALID_ARGUMENT into a metadata-too-large
// failure on the client, so every layer that names client text in a message goes through
// EchoClientText.
#include <cstddef>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvmem {

// Most bytes of a client's string that a message shows.
inline constexpr size_t kMaxEchoedBytes = 64;

// `text` escaped (C hex escapes for quotes, backslashes, control and non-ASCII bytes), cut
// to its first kMaxEchoedBytes with its length when longer: `window`, `aaaa...(200000 bytes)`.
inline std::string EchoClientText(absl::string_view text) {
  if (text.size() <= kMaxEchoedBytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, kMaxEchoedBytes)), "...(", text.size(),
                      " bytes)");
}

// Longest description in a google.rpc detail (the message's text after its field path).
inline constexpr size_t kMaxDetailTextBytes = 256;

// `text`, or when longer than `limit` bytes its first `limit` at most (cut on a UTF-8
// character's boundary) and a note of its length.
inline std::string CutMessage(absl::string_view text, size_t limit) {
  if (text.size() <= limit) return std::string(text);
  size_t cut = limit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(text.substr(0, cut), "... (message cut, ", text.size(), " bytes)");
}

}  // namespace kvmem
