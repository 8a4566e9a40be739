# CTest script: installs attnkit into a temporary prefix, builds apps/tiny_gpt (both of its
# designs, and its check against the Python reference), apps/encoder_decoder and
# apps/sentence_encoder (separate projects), the README's example (examples/, target
# quickstart) and, on a leg whose Python has torch 2.10 on, examples/aoti against it with
# find_package(attnkit), and runs them. Proves the package works as the README says.
# Inputs (-D): ATTNKIT_BINARY_DIR, ATTNKIT_SOURCE_DIR, WORK_DIR, TORCH_DIR, GENERATOR.
foreach(input ATTNKIT_BINARY_DIR ATTNKIT_SOURCE_DIR WORK_DIR TORCH_DIR GENERATOR)
  if(NOT DEFINED ${input})
    message(FATAL_ERROR "package_test.cmake: -D${input}=... is required")
  endif()
endforeach()
# LibTorch's own folder (TORCH_DIR is <it>/share/cmake/Torch) in the outside projects' prefix
# path too, as a user of pip's LibTorch writes it: TorchConfig.cmake looks for its libraries in
# its own folder only after the system's, where Debian's libtorch-dev may be.
# (The environment's CMAKE_PREFIX_PATH: a list in -D would be split by run_step's ARGN.)
get_filename_component(torch_root "${TORCH_DIR}/../../.." ABSOLUTE)
set(configure ${CMAKE_COMMAND} -E env CMAKE_PREFIX_PATH=${torch_root} ${CMAKE_COMMAND})

# A `;` in an argument would split it (run_step's ARGN is a list): Python code given with -c
# separates its statements with newlines.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "package test: ${what} failed (${result})")
  endif()
endfunction()

# The programs run with one thread each: CTest runs tests side by side on every core, and
# spinning OpenMP and OpenBLAS workers of several processes on the same cores slow each
# other down many times over (docs/threads.md).
function(run_program what)
  run_step("${what}" ${CMAKE_COMMAND} -E env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ${ARGN})
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
run_step("install" ${CMAKE_COMMAND} --install ${ATTNKIT_BINARY_DIR} --prefix ${WORK_DIR}/prefix)
# The installed Python package (docs/python.md), where the build has the operators: this leg's
# Python imports it from the prefix alone and runs its library.
file(GLOB_RECURSE python_package "${WORK_DIR}/prefix/*/attnkit/python/attnkit/__init__.py")
if(python_package)
  get_filename_component(python_dir "${python_package}" DIRECTORY)
  get_filename_component(python_dir "${python_dir}" DIRECTORY)
  set(leg_python "$ENV{ATTNKIT_PYTHON}")
  if(NOT leg_python)
    set(leg_python /usr/bin/python3)
  endif()
  run_step("import the installed Python package" ${CMAKE_COMMAND} -E env
    PYTHONPATH=${python_dir} ATTNKIT_OPS_LIBRARY= ${leg_python} -c
    "import torch, attnkit\nassert str(attnkit.library_path()).startswith('${WORK_DIR}/prefix'), attnkit.library_path()\nq = torch.randn(1, 2, 70, 8, requires_grad=True)\nattnkit.flex_attention(q, q, q).sum().backward()\nassert q.grad.abs().sum() > 0")
  # examples/aoti against the installed package: a model calling attnkit.flex_attention,
  # exported by this leg's Python (torch.export, AOTInductor: a torch of 2.10 on, which brings
  # what Inductor compiles with) and run from C++ linked with attnkit::ops; run_exported
  # checks its output against Python's within 1e-5.
  execute_process(COMMAND ${leg_python} -c "import sys, torch\nsys.exit(tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]) < (2, 10))"
    RESULT_VARIABLE old_torch)
  if(old_torch EQUAL 0)
    run_step("export examples/aoti's model" ${CMAKE_COMMAND} -E env
      PYTHONPATH=${python_dir}:${ATTNKIT_SOURCE_DIR}/scripts ATTNKIT_OPS_LIBRARY= ${leg_python} -c
      "from inductor_link import link_inductor_against_this_torch\nlink_inductor_against_this_torch()\nimport runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')"
      ${ATTNKIT_SOURCE_DIR}/examples/aoti/export_model.py ${WORK_DIR}/aoti)
    execute_process(COMMAND ${leg_python} -c "import torch\nprint(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE)
    run_step("configure examples/aoti" ${CMAKE_COMMAND} -E env
      CMAKE_PREFIX_PATH=${WORK_DIR}/prefix:${torch_prefix}:${torch_prefix}/../.. ${CMAKE_COMMAND}
      -S ${ATTNKIT_SOURCE_DIR}/examples/aoti -B ${WORK_DIR}/aoti-build -G ${GENERATOR}
      -DCMAKE_BUILD_TYPE=Release -DTorch_DIR=${TORCH_DIR})
    run_step("build examples/aoti" ${CMAKE_COMMAND} --build ${WORK_DIR}/aoti-build)
    run_program("run examples/aoti" ${WORK_DIR}/aoti-build/run_exported
      ${WORK_DIR}/aoti/model.pt2 ${WORK_DIR}/aoti 1 4 256 32 1e-5)
  endif()
endif()
run_step("configure tiny_gpt" ${configure} -S ${ATTNKIT_SOURCE_DIR}/apps/tiny_gpt
  -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR})
run_step("build tiny_gpt" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run_program("run tiny_gpt" ${WORK_DIR}/build/tiny_gpt
  --data ${ATTNKIT_SOURCE_DIR}/data/the-verdict.txt --steps 300 --sample 120)
# Its Llama-style design (RoPE, grouped-query attention, RMSNorm, SwiGLU): it learns, and it
# gives scripts/llama_reference.py's logits and tokens, prompts decoded as one ragged batch.
run_program("run tiny_gpt --llama" ${WORK_DIR}/build/tiny_gpt --llama
  --data ${ATTNKIT_SOURCE_DIR}/data/the-verdict.txt --steps 150 --sample 40)
run_program("run tiny_gpt --golden" ${WORK_DIR}/build/tiny_gpt
  --golden ${ATTNKIT_SOURCE_DIR}/data/golden/llama/reference.pt)
# Hugging Face checkpoints loaded through name maps: transformers' logits (float64 and
# float32), cached decoding against the uncached logits, and greedy tokens of a ragged batch
# (data/golden/hf, made by scripts/hf_decoder_reference.py).
foreach(model gpt2 llama3 qwen3 mistral qwen2 phi3 gemma2 gemma3)
  run_program("run tiny_gpt --hf ${model}" ${WORK_DIR}/build/tiny_gpt
    --hf ${ATTNKIT_SOURCE_DIR}/data/golden/hf/${model})
endforeach()
# Serving a file of prompts by continuous batching, then one at a time (apps/tiny_gpt/serve.h).
run_program("run tiny_gpt --serve" ${WORK_DIR}/build/tiny_gpt
  --hf ${ATTNKIT_SOURCE_DIR}/data/golden/hf/llama3 --serve ${ATTNKIT_SOURCE_DIR}/data/serve_prompts.txt)
run_program("run tiny_gpt --serve --one-at-a-time" ${WORK_DIR}/build/tiny_gpt
  --hf ${ATTNKIT_SOURCE_DIR}/data/golden/hf/llama3 --serve ${ATTNKIT_SOURCE_DIR}/data/serve_prompts.txt
  --one-at-a-time --max-new-tokens 8)
# A prompts file with a word that is not a token id of the model is named with its line.
file(WRITE ${WORK_DIR}/bad_prompts.txt "1 2 3\n4 97 5\n")
execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt --hf ${ATTNKIT_SOURCE_DIR}/data/golden/hf/gpt2
  --serve ${WORK_DIR}/bad_prompts.txt RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 1 OR NOT error MATCHES "bad_prompts.txt:2: '97' is not a token id in \\[0, 97\\)")
  message(FATAL_ERROR "package test: tiny_gpt --serve with a bad prompts file gave ${result}: ${error}")
endif()
# A folder without a checkpoint, and a dtype it does not know: each named.
execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt --hf ${ATTNKIT_SOURCE_DIR}/data/golden/llama
  RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 1 OR NOT error MATCHES "cannot open '.*/data/golden/llama/config.json'")
  message(FATAL_ERROR "package test: tiny_gpt --hf without config.json gave ${result}: ${error}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt --hf ${ATTNKIT_SOURCE_DIR}/data/golden/hf/gpt2
  --dtype float16 RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 2 OR NOT error MATCHES "--dtype must be float64, float32 or bfloat16, got 'float16'")
  message(FATAL_ERROR "package test: tiny_gpt --hf --dtype float16 gave ${result}: ${error}")
endif()
# What a config asks for that the model cannot compute is refused, naming the field.
set(hf_base [=["vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128]=])
function(expect_hf_refusal what config pattern)
  file(WRITE ${WORK_DIR}/refused/${what}/config.json "{${hf_base}, ${config}}")
  execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt --hf ${WORK_DIR}/refused/${what}
    RESULT_VARIABLE result ERROR_VARIABLE error)
  if(NOT result EQUAL 1 OR NOT error MATCHES "${pattern}")
    message(FATAL_ERROR "package test: tiny_gpt --hf refusing ${what} gave ${result}: ${error}")
  endif()
endfunction()
expect_hf_refusal(phi3_longrope
  [=["model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}]=]
  [=["rope_parameters.rope_type" must be "default" or "llama3" .*, got "longrope"]=])
expect_hf_refusal(phi3_partial_rotary
  [=["model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}]=]
  [=["rope_parameters.partial_rotary_factor" must be 1 .*, got 0.5]=])
expect_hf_refusal(gemma3_linear_rope
  [=["model_type": "gemma3_text", "sliding_window": 5, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}}]=]
  [=["rope_parameters.full_attention.rope_type" must be "default" or "llama3" .*, got "linear"]=])
expect_hf_refusal(gemma3_bidirectional
  [=["model_type": "gemma3_text", "use_bidirectional_attention": true]=]
  [=["use_bidirectional_attention" must be false .*, got true]=])
expect_hf_refusal(gemma2_layer_type
  [=["model_type": "gemma2", "sliding_window": 5, "layer_types": ["sliding_attention", "chunked_attention"]]=]
  [=["layer_types.1." must be "sliding_attention" or "full_attention", got "chunked_attention"]=])
expect_hf_refusal(gemma2_window_missing
  [=["model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"]]=]
  [=["sliding_window" must be a positive integer .layer_types.0. is sliding_attention., got null]=])
# Values transformers would misread, or that name the wrong type, refused by name.
expect_hf_refusal(gemma2_softcap_zero
  [=["model_type": "gemma2", "sliding_window": 5, "attn_logit_softcapping": 0.0]=]
  [=["attn_logit_softcapping" must be null or a finite positive number, got 0.0]=])
expect_hf_refusal(gemma2_final_softcap_zero
  [=["model_type": "gemma2", "sliding_window": 5, "final_logit_softcapping": 0.0]=]
  [=["final_logit_softcapping" must be null or a finite positive number, got 0.0]=])
expect_hf_refusal(gemma2_query_scalar_negative
  [=["model_type": "gemma2", "sliding_window": 5, "query_pre_attn_scalar": -24]=]
  [=["query_pre_attn_scalar" must be null or a finite positive number, got -24]=])
expect_hf_refusal(tied_as_string
  [=["model_type": "llama", "tie_word_embeddings": "false"]=]
  [=["tie_word_embeddings" must be true or false, got "false"]=])
expect_hf_refusal(qwen3_sliding_without_layer_types
  [=["model_type": "qwen3", "use_sliding_window": true, "sliding_window": 5]=]
  [=["use_sliding_window" must be false without layer_types .*, got true]=])
# Sizes whose weights pass the memory budget, refused by name before anything is built.
expect_hf_refusal(layers_huge
  [=["model_type": "llama", "num_hidden_layers": 1000000000]=]
  [=[more than attnkit::memory_budget.*the largest part: num_hidden_layers 1000000000 x hidden_size 32]=])
expect_hf_refusal(vocab_huge
  [=["model_type": "llama", "vocab_size": 1000000000000]=]
  [=[more than attnkit::memory_budget.*the largest part: vocab_size 1000000000000 x hidden_size 32]=])
expect_hf_refusal(positions_huge
  [=["model_type": "llama", "max_position_embeddings": 10000000000000]=]
  [=[more than attnkit::memory_budget.*the largest part: max_position_embeddings 10000000000000]=])
expect_hf_refusal(width_huge
  [=["model_type": "llama", "hidden_size": 1000000000]=]
  [=[more than attnkit::memory_budget.*the largest part: num_hidden_layers 2 x hidden_size 1000000000]=])
# A window of 10^12 tokens is the whole context: the model is built (and then the missing
# weights are named).
file(WRITE ${WORK_DIR}/accepted/window_huge/config.json
  [=[{"model_type": "mistral", "sliding_window": 1000000000000, "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}]=])
file(COPY ${ATTNKIT_SOURCE_DIR}/data/golden/hf/mistral/reference.safetensors
  DESTINATION ${WORK_DIR}/accepted/window_huge)
execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt --hf ${WORK_DIR}/accepted/window_huge
  RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 1 OR NOT error MATCHES "cannot open '[^']*/window_huge/model.safetensors'")
  message(FATAL_ERROR "package test: tiny_gpt --hf with a window of 10^12 gave ${result}: ${error}")
endif()
# A key the architecture's transformers class ignores is ignored: Llama 3's checkpoint with
# "sliding_window": 3 still answers as transformers computed it (tiny_gpt windowed every layer,
# and its logits were 7.8 off).
file(READ ${ATTNKIT_SOURCE_DIR}/data/golden/hf/llama3/config.json llama_config)
string(REPLACE [=["model_type"]=] [=["sliding_window": 3, "model_type"]=] llama_config
  "${llama_config}")
file(WRITE ${WORK_DIR}/accepted/llama3_sliding_window/config.json "${llama_config}")
file(COPY ${ATTNKIT_SOURCE_DIR}/data/golden/hf/llama3/model.safetensors
  ${ATTNKIT_SOURCE_DIR}/data/golden/hf/llama3/reference.safetensors
  DESTINATION ${WORK_DIR}/accepted/llama3_sliding_window)
run_program("run tiny_gpt --hf llama3 with sliding_window 3" ${WORK_DIR}/build/tiny_gpt
  --hf ${WORK_DIR}/accepted/llama3_sliding_window)
expect_hf_refusal(mixtral
  [=["model_type": "mixtral"]=]
  [=["model_type" must be "gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2" or "gemma3_text", got "mixtral"]=])
# Another golden file (RoPE's) is named as the wrong one, with exit code 1.
execute_process(COMMAND ${WORK_DIR}/build/tiny_gpt
  --golden ${ATTNKIT_SOURCE_DIR}/data/golden/rope/reference.pt
  RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 1 OR NOT error MATCHES "--golden: the file has no 'llama/config/vocab'")
  message(FATAL_ERROR "package test: tiny_gpt --golden with the wrong file gave ${result}: ${error}")
endif()

# The encoder-decoder of seed 001's shape (padded sources, cross-attention): it exits 1
# unless greedy decoding reverses at least 90% of new strings.
run_step("configure encoder_decoder" ${configure} -S ${ATTNKIT_SOURCE_DIR}/apps/encoder_decoder
  -B ${WORK_DIR}/encoder_decoder -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR})
run_step("build encoder_decoder" ${CMAKE_COMMAND} --build ${WORK_DIR}/encoder_decoder)
run_program("run encoder_decoder" ${WORK_DIR}/encoder_decoder/encoder_decoder)

# The pretrained sentence encoder as a project of its own (apps/sentence_encoder/README.md):
# it builds against the package, and says what it needs without a model (the model itself is
# checked on the pip leg, whose Python has it: sentence_encoder.matches_sentence_transformers).
run_step("configure sentence_encoder" ${configure} -S ${ATTNKIT_SOURCE_DIR}/apps/sentence_encoder
  -B ${WORK_DIR}/sentence_encoder -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR})
run_step("build sentence_encoder" ${CMAKE_COMMAND} --build ${WORK_DIR}/sentence_encoder)
execute_process(COMMAND ${WORK_DIR}/sentence_encoder/sentence_encoder --model ${WORK_DIR}/none "x"
  RESULT_VARIABLE result ERROR_VARIABLE error)
if(NOT result EQUAL 2 OR NOT error MATCHES "cannot open the model's config")
  message(FATAL_ERROR "package test: sentence_encoder without a model gave ${result}: ${error}")
endif()

# The README's find_package lines, as examples/CMakeLists.txt holds them, and its example.
run_step("configure examples" ${configure} -S ${ATTNKIT_SOURCE_DIR}/examples
  -B ${WORK_DIR}/examples -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${TORCH_DIR})
run_step("build the README's example" ${CMAKE_COMMAND} --build ${WORK_DIR}/examples
  --target quickstart)
run_program("run the README's example" ${WORK_DIR}/examples/quickstart)
