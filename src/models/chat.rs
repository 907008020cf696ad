//! Chat prompts: ChatML (SmolLM2-Instruct's chat template). Plain string
//! formatting; tokenising the result is [`super::tokenizer`]'s job, and this
//! module imports nothing of the crate.

/// SmolLM2-Instruct's default system prompt, inserted by its chat template
/// when the conversation does not start with a system message.
pub const SMOLLM2_SYSTEM_PROMPT: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Formats a conversation as ChatML:
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, with
/// `default_system` first when the first message is not a system message,
/// and `<|im_start|>assistant\n` at the end when `add_generation_prompt`.
/// With `default_system = Some(SMOLLM2_SYSTEM_PROMPT)` this is
/// SmolLM2-Instruct's chat template.
pub fn chatml_prompt(
    messages: &[ChatMessage],
    default_system: Option<&str>,
    add_generation_prompt: bool,
) -> String {
    let mut out = String::new();
    let starts_with_system = messages.first().is_some_and(|m| m.role == "system");
    if let (false, Some(system)) = (starts_with_system, default_system) {
        out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
    }
    for m in messages {
        out.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// SmolLM2-Instruct's prompt for one user message.
pub fn smollm2_chat_prompt(user: &str) -> String {
    chatml_prompt(
        &[ChatMessage::new("user", user)],
        Some(SMOLLM2_SYSTEM_PROMPT),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_template_is_chatml_with_default_system() {
        assert_eq!(
            smollm2_chat_prompt("Hi"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let own_system = chatml_prompt(
            &[
                ChatMessage::new("system", "S"),
                ChatMessage::new("user", "U"),
            ],
            Some(SMOLLM2_SYSTEM_PROMPT),
            false,
        );
        assert_eq!(
            own_system,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }
}
