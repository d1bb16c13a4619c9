// The `model` keys each family's reader knows (models/<family>_config.cpp reads them; the rest
// of a section is kept as HF's extra keys), and the Hugging Face config.json keys that no reader
// needs. Header-only data: the config parser's near-miss warning (a `model` key one typo away from
// a known one) and the readers share these lists. BERT/RoBERTa's are bert_config.h's visit().
#pragma once

#include <string>
#include <vector>

namespace polytrain {

inline const std::vector<std::string> kGpt2ConfigKeys = {
    "model_type", "vocab_size", "n_positions", "max_position_embeddings", "n_embd", "hidden_size", "n_layer",
    "num_hidden_layers", "n_head", "num_attention_heads", "n_inner", "activation_function", "resid_pdrop",
    "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "fused_lm_loss", "attn_implementation"};

inline const std::vector<std::string> kAlbertConfigKeys = {
    "model_type", "vocab_size", "embedding_size", "hidden_size", "d_model", "num_hidden_layers",
    "num_hidden_groups", "num_attention_heads", "intermediate_size", "inner_group_num", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "classifier_dropout_prob", "pad_token_id", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "sentence_order_prediction", "sparse_prediction", "fused_lm_loss"};

/// T5's (model_type is checked by the polytrain config, not by t5_config_from_json).
inline const std::vector<std::string> kT5ConfigKeys = {
    "vocab_size", "d_model", "hidden_size", "d_kv", "head_dim", "d_ff", "num_layers", "num_hidden_layers",
    "num_decoder_layers", "num_heads", "num_attention_heads", "relative_attention_num_buckets",
    "relative_attention_max_distance", "dropout_rate", "layer_norm_epsilon", "initializer_factor",
    "feed_forward_proj", "tie_word_embeddings", "pad_token_id", "eos_token_id", "decoder_start_token_id",
    "dense_act_fn", "is_gated_act", "attn_implementation"};

/// Keys of transformers' PretrainedConfig and of the families' published config.json files that
/// polytrain does not read: kept for export, never warned about.
inline const std::vector<std::string> kHfOtherConfigKeys = {
    "_name_or_path", "architectures", "torch_dtype", "transformers_version", "position_embedding_type",
    "use_cache", "classifier_dropout", "gradient_checkpointing", "bos_token_id", "eos_token_id", "sep_token_id",
    "pad_token_id", "decoder_start_token_id", "is_decoder", "is_encoder_decoder", "add_cross_attention",
    "tie_encoder_decoder", "output_past", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "tokenizer_class", "task_specific_params", "finetuning_task", "prefix", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "pruned_heads", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "n_ctx",
    "n_positions", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "layer_norm_eps", "layer_norm_epsilon", "initializer_range", "model_type"};

}  // namespace polytrain
