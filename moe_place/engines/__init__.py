"""moe_place.engines"""
