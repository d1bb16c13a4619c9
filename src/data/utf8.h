// UTF-8 <-> code points, shared by the tokenizers.
#pragma once

#include <string>
#include <string_view>

namespace polytrain {

/// Decodes UTF-8; a malformed, overlong or surrogate sequence yields U+FFFD for its first byte.
std::u32string decode_utf8(std::string_view s);
/// Appends c (a valid code point) as UTF-8.
void append_utf8(char32_t c, std::string& out);
/// s with every invalid sequence replaced as decode_utf8 does; s itself when it is valid.
std::string sanitize_utf8(std::string_view s);

}  // namespace polytrain
