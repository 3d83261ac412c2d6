// The extra.dcp section of a manifest (include/cairn/value_codec.h).
#include <nlohmann/json.hpp>

#include "cairn/value_codec.h"

namespace cairn {

using nlohmann::json;

Result<std::string> ExtraWithDcpSection(std::string_view extra, const DcpSection& dcp) {
  json out = json::parse(extra, nullptr, /*allow_exceptions=*/false);
  if (!out.is_object()) return InvalidArgumentError("manifest extra must be a JSON object");
  auto opt = [](const std::optional<std::string>& s) { return s ? json(*s) : json(); };
  CAIRN_ASSIGN_OR_RETURN(std::string planner, EncodePlannerData(dcp.planner_data));
  json section = {{"version", opt(dcp.version)},
                  {"planner_data", json::parse(planner)},
                  {"storage_meta", nullptr}};
  if (const auto& sm = dcp.storage_meta) {
    section["storage_meta"] = {{"checkpoint_id", opt(sm->checkpoint_id)},
                               {"save_id", opt(sm->save_id)},
                               {"modules", sm->modules}};
  }
  out["dcp"] = std::move(section);
  return out.dump();
}

Result<DcpSection> ReadDcpSection(std::string_view extra) {
  DcpSection out;
  json all = json::parse(extra, nullptr, /*allow_exceptions=*/false);
  json dcp = all.is_object() ? all.value("dcp", json()) : json();
  if (dcp.is_null()) return out;
  if (!dcp.is_object()) return DataLossError("malformed 'extra.dcp' section in the manifest");
  if (auto v = dcp.find("version"); v != dcp.end() && v->is_string()) out.version = *v;
  if (auto p = dcp.find("planner_data"); p != dcp.end()) {
    CAIRN_ASSIGN_OR_RETURN(out.planner_data, DecodePlannerData(p->dump()));
  }
  if (auto sm = dcp.find("storage_meta"); sm != dcp.end() && sm->is_object()) {
    auto str = [&](const char* key) -> std::optional<std::string> {
      auto f = sm->find(key);
      if (f == sm->end() || !f->is_string()) return std::nullopt;
      return f->get<std::string>();
    };
    DcpSection::StorageMeta meta{str("checkpoint_id"), str("save_id"), {}};
    if (auto mods = sm->find("modules"); mods != sm->end() && mods->is_array()) {
      for (const json& e : *mods) {
        if (e.is_string()) meta.modules.push_back(e.get<std::string>());
      }
    }
    out.storage_meta = std::move(meta);
  }
  return out;
}

}  // namespace cairn
